//! What only a node does (docs/architecture.md, "Edges and nodes"): `codex-fleet node --tenant ID` serves
//! exactly one tenant, with the entry its edge handed it, and `--exit-when-idle` ends the node
//! once nothing runs, so its pod completes; and a link's upgrade, after mutual TLS, is admitted
//! by the headers that name its session ([`link::admit`]).

pub mod idle;
pub mod link;
pub mod tenant;
