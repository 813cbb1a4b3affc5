//! Writes the transformer example's corpus the ways a corpus too large to embed is prepared:
//! as token files (byte tokens, the model being byte-level, in llm.c's `.bin` format: the first
//! 90 % of Shakespeare's text as `train_*.bin`, the rest as `val_*.bin`), or with `--parquet`
//! (`--arrow`) as Parquet (Arrow IPC) files in the Hugging Face hub's naming
//! (`train-00000-of-00002.parquet`, ..., `validation-...`) whose `text` rows are the windows of
//! `--context + 1` bytes.
//!
//! ```text
//! cargo run --release --example prepare_data -- --out data/shakespeare-tokens
//! cargo run --release --example transformer_lm -- --data data/shakespeare-tokens
//! cargo run --release --example prepare_data -- --parquet --out data/shakespeare-parquet
//! cargo run --release --example transformer_lm -- --data data/shakespeare-parquet
//! cargo run --release --example prepare_data -- --arrow --out data/shakespeare-arrow
//! cargo run --release --example transformer_lm -- --data data/shakespeare-arrow
//! ```
//!
//! Token files with one file per split (the default) give exactly the embedded text's
//! windows, so training from them trains bit for bit what the default run trains. Parquet
//! files give the same windows, read in another order (each process its own row groups);
//! Arrow files give them in the embedded text's order, so again the default run bit for bit.

use std::path::PathBuf;

use accelerate_examples::text::{self, RowFormat};
use clap::Parser;

/// Where to write, and how large each file is.
#[derive(Parser, Debug)]
#[command(
    about = "Writes Shakespeare's text as llm.c token files, Parquet or Arrow files for transformer_lm --data"
)]
struct Args {
    /// The folder to write to (created if missing; files in it are never replaced).
    #[arg(long)]
    out: PathBuf,
    /// Tokens per file at most (several files per split when smaller than the split).
    #[arg(long, default_value_t = usize::MAX)]
    tokens_per_file: usize,
    /// Token files: the training text written this many times over (a larger corpus, for
    /// measuring what size costs).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Writes Parquet files with a `text` column instead of token files.
    #[arg(long, conflicts_with = "arrow")]
    parquet: bool,
    /// Writes Arrow IPC files with a `text` column instead of token files.
    #[arg(long)]
    arrow: bool,
    /// With --parquet or --arrow: the context the rows are windows for (rows of context + 1
    /// bytes).
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// With --parquet or --arrow: rows per file.
    #[arg(long, default_value_t = 20_000)]
    rows_per_file: usize,
    /// With --parquet or --arrow: rows per row group (record batch).
    #[arg(long, default_value_t = 4096)]
    rows_per_group: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    let rows = match (args.parquet, args.arrow) {
        (true, _) => Some(RowFormat::Parquet),
        (_, true) => Some(RowFormat::Arrow),
        _ => None,
    };
    let files = if let Some(format) = rows {
        let shape = (args.rows_per_file, args.rows_per_group);
        text::write_text_rows(&args.out, format, args.context + 1, shape)?
    } else {
        text::write_repeated_token_files(&args.out, args.tokens_per_file, args.repeat)?
    };
    for file in &files {
        println!("{}", file.display());
    }
    Ok(())
}
