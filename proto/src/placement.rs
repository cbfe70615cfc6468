//! How a tenant's pool of workers answers each client method of the pinned app-server, so that
//! it answers as one app-server would (docs/decisions/0013-parse-once-one-method-table.md);
//! docs/architecture.md "One app-server per tenant" is this table in prose. Every client request of
//! the pinned schema has a row (`router/tests/method_table.rs` checks it against the binary), so a
//! new method has to be placed before it ships.

/// Where a client request is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// `initialize`: answered by the session's home worker and replayed (answer and
    /// per-connection notifications hidden) on every further leg.
    Connection,
    /// Asked of every live worker of the tenant; the answers merged.
    Merged,
    /// The request names a thread (`threadId`, required): the worker that has it loaded, the
    /// home worker for a thread loaded nowhere (`thread/resume` is placed then).
    Thread,
    /// `threadId` is optional: the thread's worker when given, else the home worker; the answer
    /// then does not depend on the process (shared CODEX_HOME, config, account).
    ThreadOrShared,
    /// A new thread: the least-loaded worker.
    Placed,
    /// The home worker; any worker gives the same answer: it reads or writes what all the
    /// tenant's workers share (CODEX_HOME files and state database, config, account, the host's
    /// files under the tenant's uid, the backend).
    Shared,
    /// The home worker, which keeps state for this connection (exec processes, watches, search
    /// and login sessions, event streams): the follow-up requests find it there, since a
    /// session's home leg stays while the session lives.
    Sticky,
    /// The home worker, but the answer or effect is that one process's own, so it differs from
    /// one app-server's when a tenant has more workers (docs/architecture.md lists these and why).
    ProcessLocal,
    /// Refused by every host-access policy.
    Refused,
}

impl Placement {
    /// Every placement, in the order of docs/architecture.md's table.
    pub const ALL: [Placement; 9] = [
        Placement::Connection,
        Placement::Merged,
        Placement::Thread,
        Placement::ThreadOrShared,
        Placement::Placed,
        Placement::Shared,
        Placement::Sticky,
        Placement::ProcessLocal,
        Placement::Refused,
    ];

    /// The placement of a client request of the pinned app-server; `None` for a method it does
    /// not have (the router's policy refuses those).
    pub fn of(method: &str) -> Option<Placement> {
        use Placement::*;
        Some(match method {
            "initialize" => Connection,
            "thread/list" | "thread/loaded/list" => Merged,
            "thread/start" => Placed,
            "thread/resume"
            | "thread/fork"
            | "thread/sample"
            | "thread/archive"
            | "thread/unarchive"
            | "thread/delete"
            | "thread/unsubscribe"
            | "thread/increment_elicitation"
            | "thread/decrement_elicitation"
            | "thread/name/set"
            | "thread/prediction/request"
            | "thread/goal/set"
            | "thread/goal/get"
            | "thread/goal/clear"
            | "thread/queue/add"
            | "thread/queue/list"
            | "thread/queue/update"
            | "thread/queue/delete"
            | "thread/queue/reorder"
            | "thread/queue/start"
            | "thread/metadata/update"
            | "thread/attachment/add"
            | "thread/attachment/list"
            | "thread/attachment/remove"
            | "thread/section/move"
            | "thread/settings/update"
            | "thread/memoryMode/set"
            | "thread/memory/read"
            | "thread/compact/start"
            | "thread/shellCommand"
            | "thread/approveGuardianDeniedAction"
            | "thread/backgroundTerminals/clean"
            | "thread/backgroundTerminals/list"
            | "thread/backgroundTerminals/terminate"
            | "thread/revert"
            | "thread/searchOccurrences"
            | "thread/read"
            | "thread/readState/update"
            | "thread/turns/list"
            | "thread/items/list"
            | "thread/items/read"
            | "thread/guardianReview"
            | "thread/inject_items"
            | "thread/prepareApprovedPlan"
            | "thread/realtime/start"
            | "thread/realtime/appendAudio"
            | "thread/realtime/appendText"
            | "thread/realtime/appendSpeech"
            | "thread/realtime/stop"
            | "thread/realtime/list"
            | "thread/timeline/list"
            | "turn/start"
            | "turn/settings/update"
            | "turn/steer"
            | "turn/interrupt"
            | "review/start"
            | "mcpServer/event/stream/start"
            | "mcpServer/tool/call" => Thread,
            "hooks/list"
            | "app/read"
            | "app/list"
            | "app/installed"
            | "experimentalFeature/list"
            | "mcpServer/oauth/login"
            | "mcpServerStatus/list"
            | "mcpServer/resource/read"
            | "account/usage/read"
            | "feedback/upload"
            | "feedback/save" => ThreadOrShared,
            "userVerification/status"
            | "userVerification/enroll"
            | "userVerification/delete"
            | "userVerification/verify"
            | "memory/status"
            | "memory/reset"
            | "rollout/compress"
            | "thread/attachmentOwner/list"
            | "project/list"
            | "project/read"
            | "project/create"
            | "project/import"
            | "project/update"
            | "project/move"
            | "project/delete"
            | "threadSection/list"
            | "threadSection/create"
            | "threadSection/update"
            | "threadSection/delete"
            | "thread/search"
            | "skills/list"
            | "marketplace/add"
            | "marketplace/remove"
            | "marketplace/upgrade"
            | "plugin/list"
            | "plugin/search"
            | "plugin/installed"
            | "plugin/reconcile"
            | "plugin/read"
            | "plugin/skill/read"
            | "plugin/share/save"
            | "plugin/share/updateTargets"
            | "plugin/share/list"
            | "plugin/share/checkout"
            | "plugin/share/delete"
            | "plugin/install"
            | "plugin/uninstall"
            | "fs/readFile"
            | "fs/writeFile"
            | "fs/createDirectory"
            | "fs/getMetadata"
            | "fs/readDirectory"
            | "fs/remove"
            | "fs/copy"
            | "skills/config/write"
            | "thread/realtime/listVoices"
            | "model/list"
            | "account/gatewayOAuth/read"
            | "modelProvider/list"
            | "modelProvider/capabilities/read"
            | "permissionProfile/list"
            | "collaborationMode/list"
            | "windowsSandbox/setupStart"
            | "windowsSandbox/readiness"
            | "account/bedrock/discover"
            | "account/bedrock/setup"
            | "account/gcp/setup"
            | "account/bedrock/checkGovCloudRequirements"
            | "accountSession/list"
            | "accountSession/switch"
            | "account/securitySetup/read"
            | "account/rateLimits/read"
            | "account/rateLimitResetCredit/consume"
            | "account/workspaceMessages/read"
            | "account/sendAddCreditsNudgeEmail"
            | "account/read"
            | "config/read"
            | "configRequirements/read"
            | "externalAgentConfig/detect"
            | "externalAgentConfig/import"
            | "externalAgentConfig/import/recordHistory"
            | "externalAgentConfig/import/readHistories"
            | "fuzzyFileSearch" => Shared,
            "userVerification/cancel"
            | "thread/search/stream"
            | "thread/search/cancel"
            | "thread/search/stream/cancel"
            | "fs/watch"
            | "fs/unwatch"
            | "account/gatewayOAuth/login"
            | "account/gatewayOAuth/cancel"
            | "account/login/start"
            | "account/login/cancel"
            | "command/exec"
            | "command/exec/write"
            | "command/exec/terminate"
            | "command/exec/resize"
            | "process/spawn"
            | "process/writeStdin"
            | "process/kill"
            | "process/resizePty"
            | "fuzzyFileSearch/sessionStart"
            | "fuzzyFileSearch/sessionUpdate"
            | "fuzzyFileSearch/sessionStop" => Sticky,
            "server/diagnostics"
            | "thread/sample/cancel"
            | "mcpServer/event/stream/stop"
            | "skills/extraRoots/set"
            | "modelProvider/config/write"
            | "modelProvider/default/set"
            | "experimentalFeature/enablement/set"
            | "remoteControl/enable"
            | "remoteControl/disable"
            | "remoteControl/status/read"
            | "remoteControl/pairing/start"
            | "remoteControl/pairing/status"
            | "remoteControl/client/list"
            | "remoteControl/client/revoke"
            | "environment/add"
            | "environment/info"
            | "environment/status"
            | "config/mcpServer/reload"
            | "config/value/write"
            | "config/batchWrite"
            | "account/logout" => ProcessLocal,
            "mock/experimentalMethod" => Refused,
            _ => return None,
        })
    }

    /// Its name in docs/architecture.md's table.
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::Connection => "connection",
            Placement::Merged => "merged",
            Placement::Thread => "thread",
            Placement::ThreadOrShared => "thread or shared",
            Placement::Placed => "placed",
            Placement::Shared => "shared",
            Placement::Sticky => "sticky",
            Placement::ProcessLocal => "process-local",
            Placement::Refused => "refused",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::method::Method;

    #[test]
    fn the_methods_the_router_acts_on_are_placed_as_it_routes_them() {
        assert_eq!(
            Placement::of(Method::Initialize.as_str()),
            Some(Placement::Connection)
        );
        assert_eq!(
            Placement::of(Method::ThreadStart.as_str()),
            Some(Placement::Placed)
        );
        for m in [Method::ThreadList, Method::ThreadLoadedList] {
            assert_eq!(Placement::of(m.as_str()), Some(Placement::Merged), "{m}");
        }
        for m in [
            Method::ThreadResume,
            Method::ThreadFork,
            Method::ThreadRead,
            Method::TurnStart,
            Method::TurnInterrupt,
        ] {
            assert_eq!(Placement::of(m.as_str()), Some(Placement::Thread), "{m}");
        }
        assert_eq!(Placement::of("thread/notAMethodYet"), None);
    }
}
