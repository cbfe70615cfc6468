//! How a client connection ends: the close code and reason the client reads and the label a
//! metric counts, the same for a session served here and one an edge relays.

use std::time::Duration;

use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

use crate::admission::FLOOD_CLOSE_REASON;

/// After a 1009 close, how long the socket stays open (unread) before it is dropped.
pub const TOO_BIG_LINGER: Duration = Duration::from_millis(500);

/// Why a session ended; decides the close frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// The client closed or vanished.
    ClientGone,
    /// codex-fleet is shutting down (1001).
    Shutdown,
    /// The client did not read fast enough (1008).
    SlowClient,
    /// A message over the size limit (1009).
    TooBig,
    /// Too many protocol errors in a row (1008).
    ProtocolErrors,
    /// Notifications or responses beyond the connection's frame rate (1008): they cannot be
    /// answered with `-32001` and are never dropped silently.
    Flooded,
    /// The credential that admitted the session expired (1008, [`EXPIRED_REASON`]).
    CredentialExpired,
    /// A reload removed the session's token, key or tenant (1008, [`REVOKED_REASON`]).
    CredentialRevoked,
    /// The workers asked more approvals than the session may hold unanswered (1008,
    /// [`TOO_MANY_PROMPTS_REASON`]): forgetting one would let its decision pass unaudited.
    TooManyPrompts,
    /// The session fell further behind its tenant's relayed broadcasts than the relay holds
    /// (1008, [`RELAY_LAGGED_REASON`]): what it missed (status changes, a followed thread's move)
    /// is gone, so the client reconnects and reads the threads afresh rather than go on with a
    /// wrong picture, as app-server disconnects a connection whose outbound queue filled.
    RelayLagged,
    /// A large frame read would take the read buffers the tenant's sockets keep over its bound
    /// (1008, [`LARGE_FRAMES_REASON`]; `admission::HeldBuffer`): ending the session frees its
    /// own.
    LargeFrames,
}

/// Close reason of a session whose JWT expired.
pub const EXPIRED_REASON: &str = "codex-fleet: the credential expired; reconnect with a new token";
/// Close reason of a session whose credential or tenant a reload removed.
pub const REVOKED_REASON: &str = "codex-fleet: the credential was revoked";
/// Close reason of a session holding too many unanswered approvals.
pub const TOO_MANY_PROMPTS_REASON: &str = "codex-fleet: too many approvals awaiting an answer";
/// Close reason of a session whose large frame found its tenant's buffers full.
pub const LARGE_FRAMES_REASON: &str =
    "codex-fleet: the tenant's connections hold too many large messages; reconnect";
/// Close reason of a session that missed relayed broadcasts.
pub const RELAY_LAGGED_REASON: &str =
    "codex-fleet: fell behind the tenant's broadcasts; reconnect to read the threads afresh";

impl From<crate::credentials::CredentialEnd> for End {
    fn from(e: crate::credentials::CredentialEnd) -> End {
        match e {
            crate::credentials::CredentialEnd::Expired => End::CredentialExpired,
            crate::credentials::CredentialEnd::Revoked => End::CredentialRevoked,
        }
    }
}

impl End {
    /// Every way a session ends, so each series exists (at zero) from the start.
    pub const ALL: [End; 11] = [
        End::ClientGone,
        End::Shutdown,
        End::SlowClient,
        End::TooBig,
        End::ProtocolErrors,
        End::Flooded,
        End::CredentialExpired,
        End::CredentialRevoked,
        End::TooManyPrompts,
        End::RelayLagged,
        End::LargeFrames,
    ];

    /// The `reason` of `codex_fleet_sessions_closed_total`.
    pub fn label(&self) -> &'static str {
        match self {
            End::ClientGone => "client",
            End::Shutdown => "shutdown",
            End::SlowClient => "slow_client",
            End::TooBig => "too_big",
            End::ProtocolErrors => "protocol_errors",
            End::Flooded => "flooded",
            End::CredentialExpired => "credential_expired",
            End::CredentialRevoked => "credential_revoked",
            End::TooManyPrompts => "too_many_prompts",
            End::RelayLagged => "relay_lagged",
            End::LargeFrames => "large_frames",
        }
    }

    /// The close frame to send, if any.
    pub fn close_frame(&self) -> Option<CloseFrame> {
        let (code, reason) = match self {
            End::ClientGone => return None,
            End::Shutdown => (CloseCode::Away, "codex-fleet is shutting down"),
            End::SlowClient => (CloseCode::Policy, "client is not reading fast enough"),
            End::TooBig => (CloseCode::Size, "message too big"),
            End::ProtocolErrors => (CloseCode::Policy, "too many protocol errors"),
            End::Flooded => (CloseCode::Policy, FLOOD_CLOSE_REASON),
            End::CredentialExpired => (CloseCode::Policy, EXPIRED_REASON),
            End::CredentialRevoked => (CloseCode::Policy, REVOKED_REASON),
            End::TooManyPrompts => (CloseCode::Policy, TOO_MANY_PROMPTS_REASON),
            End::RelayLagged => (CloseCode::Policy, RELAY_LAGGED_REASON),
            End::LargeFrames => (CloseCode::Policy, LARGE_FRAMES_REASON),
        };
        Some(CloseFrame {
            code,
            reason: reason.into(),
        })
    }
}
