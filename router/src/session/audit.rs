//! What a session writes to the audit log: the tenant and subject on every event, approvals
//! requested of the client and the decisions it sent back.

use serde_json::json;
use serde_json::value::RawValue;
use worker::WorkerId;

use super::Session;

/// Approvals awaiting an answer that a session remembers for the audit log.
const AUDITED_APPROVALS: usize = 1024;

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

    /// An approval or user-input request from a worker: recorded, and remembered until the
    /// client answers it.
    pub(super) fn audit_approval_request(
        &mut self,
        worker: WorkerId,
        sid: i64,
        method: &str,
        params: Option<&serde_json::value::RawValue>,
    ) {
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
        if self.approvals.len() < AUDITED_APPROVALS {
            self.approvals.insert(sid, asked);
        }
    }

    /// The client answered server request `sid`: if it was an approval, its decision goes to the
    /// audit log before the worker acts on it.
    pub(super) async fn audit_approval_answer(
        &mut self,
        sid: i64,
        result: Option<&RawValue>,
        error: Option<&RawValue>,
    ) {
        let Some(mut asked) = self.approvals.remove(&sid) else {
            return;
        };
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
