//! The subcommands beside the server itself: `codex-fleet dev` (the embedded default with a
//! local tenant) and `codex-fleet top` (the capacity dashboard's questions in a terminal).

pub mod dev;
pub mod top;
