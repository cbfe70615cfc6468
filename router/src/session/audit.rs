//! What a session writes to the audit log: the tenant and subject on every event, approvals
//! requested of the client and the decisions it sent back.

use serde_json::json;
use serde_json::value::RawValue;
use worker::WorkerId;

use super::Session;

/// Worker requests that ask the client to approve something or to answer the user's question.
pub(super) fn is_approval(method: &str) -> bool {
    method.ends_with("requestApproval") || method.ends_with("requestUserInput")
}

// === impl Session ===

impl Session {
    /// Records an audit event with the session's tenant and subject.
    pub(super) fn audit(&self, event: &str, mut fields: serde_json::Value) {
        fields["tenant"] = json!(self.ctx.tenant.id);
        fields["subject"] = json!(self.ctx.subject);
        self.ctx.audit.record(event, fields);
    }

    /// An approval or user-input request from a worker: recorded; returns what it asked, to be
    /// remembered with the request until the client answers it.
    pub(super) fn audit_approval_request(
        &self,
        worker: WorkerId,
        method: &str,
        params: Option<&serde_json::value::RawValue>,
    ) -> serde_json::Value {
        let p = params
            .and_then(|p| serde_json::from_str::<serde_json::Value>(p.get()).ok())
            .unwrap_or_default();
        let asked = json!({
            "method": method,
            "thread": p.get("threadId"),
            "turn": p.get("turnId"),
            "item": p.get("itemId"),
            "command": crate::audit::summary(p.get("command")),
            "cwd": p.get("cwd"),
            "reason": crate::audit::summary(p.get("reason")),
            "worker": worker.to_string(),
        });
        self.audit("approval.requested", asked.clone());
        asked
    }

    /// An approval that will never be answered through this session: `why` it was withdrawn
    /// (`resolved` elsewhere or aborted, `turn_ended`, `worker_lost`, `too_many_pending`).
    pub(super) fn audit_approval_withdrawn(&self, mut asked: serde_json::Value, why: &str) {
        asked["why"] = json!(why);
        self.audit("approval.withdrawn", asked);
    }

    /// The client answered an approval that `asked`: its decision goes to the audit log before
    /// the worker acts on it.
    pub(super) async fn audit_approval_answer(
        &self,
        mut asked: serde_json::Value,
        result: Option<&RawValue>,
        error: Option<&RawValue>,
    ) {
        let value = |raw: Option<&RawValue>| {
            raw.and_then(|r| serde_json::from_str::<serde_json::Value>(r.get()).ok())
        };
        // The client's answer: bounded, whatever it holds.
        let decision = match value(result) {
            Some(r) => r.get("decision").cloned().unwrap_or(r),
            None => json!({ "error": value(error) }),
        };
        asked["decision"] = crate::untrusted::Untrusted::value(&decision);
        asked["tenant"] = json!(self.ctx.tenant.id);
        asked["subject"] = json!(self.ctx.subject);
        self.ctx
            .audit
            .record_written("approval.answered", asked)
            .await;
    }
}
