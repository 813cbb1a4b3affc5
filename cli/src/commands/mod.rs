//! One module per subcommand.

pub mod config;
pub mod env;
pub mod estimate_memory;
pub mod launch;
pub mod merge_weights;
pub mod test;
