//! One module per subcommand.

pub mod env;
pub mod launch;
