//! One module per subcommand.

pub mod env;
