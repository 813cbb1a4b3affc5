//! One module per subcommand.

pub mod config;
pub mod env;
pub mod launch;
pub mod test;
