//! What only a node does (docs/architecture.md, "Edges and nodes"): `codex-fleet node --tenant ID` serves
//! exactly one tenant, with the entry its edge handed it, and `--exit-when-idle` ends the node
//! once nothing runs, so its pod completes. The link's upgrade (mutual TLS, then the headers that
//! name the session) is answered by the shared listener with [`crate::edge::headers::read`].

pub mod idle;
pub mod tenant;
