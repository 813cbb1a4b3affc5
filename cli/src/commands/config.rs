//! `accelerate-rs config`: write the config file that `launch` and `Accelerator::from_env` read,
//! by asking a few questions, with `--default`, or from Hugging Face Accelerate's YAML.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;

use accelerate_core::MixedPrecision;
use accelerate_core::config_file::{self, ConfigFile};
use accelerate_core::state::ProcessEnv;
use anyhow::{Context, bail};
use clap::Args;

/// Write the config file (by default `$XDG_CONFIG_HOME/accelerate-rs/config.toml`, i.e.
/// `~/.config/accelerate-rs/config.toml`) by answering a few questions.
///
/// Examples:
///   accelerate-rs config                      # asks; Enter keeps the default shown
///   accelerate-rs config --default            # one process, no mixed precision
///   accelerate-rs config --from-accelerate    # converts ~/.cache/huggingface/accelerate/default_config.yaml
#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// Write the defaults without asking.
    #[arg(long, conflicts_with = "from_accelerate")]
    default: bool,

    /// Convert Hugging Face Accelerate's config (its default file when no path is given),
    /// keeping the keys that mean the same here and naming the others.
    #[arg(long, value_name = "YAML", num_args = 0..=1, default_missing_value = "")]
    from_accelerate: Option<PathBuf>,

    /// Where to write, instead of the default location.
    #[arg(long, value_name = "FILE")]
    config_file: Option<PathBuf>,
}

/// Runs the command.
pub fn run(args: ConfigArgs) -> anyhow::Result<ExitCode> {
    let path = match args.config_file {
        Some(path) => path,
        None => config_file::default_path(&ProcessEnv)
            .context("neither XDG_CONFIG_HOME nor HOME is set; hint: pass --config-file")?,
    };
    let file = if args.default {
        ConfigFile {
            num_processes: Some(1),
            num_machines: Some(1),
            mixed_precision: Some(MixedPrecision::No),
            use_cpu: Some(false),
            ..ConfigFile::default()
        }
    } else if let Some(yaml) = args.from_accelerate {
        let yaml = if yaml.as_os_str().is_empty() {
            config_file::accelerate_default_path(&ProcessEnv)
                .context("HOME is not set; hint: give the YAML file's path")?
        } else {
            yaml
        };
        let loaded = config_file::parse_accelerate_yaml(
            &yaml,
            &std::fs::read_to_string(&yaml)
                .with_context(|| format!("reading {}", yaml.display()))?,
        )?;
        if let Some(note) = loaded.ignored_note() {
            eprintln!("note: {note}");
        }
        loaded.file
    } else {
        let stdin = std::io::stdin();
        ask_all(&mut stdin.lock(), &mut std::io::stderr())?
    };
    config_file::write(&path, &file)?;
    println!("accelerate-rs configuration saved at {}", path.display());
    Ok(ExitCode::SUCCESS)
}

/// Asks the questions on `output`, reading answers from `input`.
fn ask_all(input: &mut impl BufRead, output: &mut impl Write) -> anyhow::Result<ConfigFile> {
    let mut ask = Asker { input, output };
    let mut file = ConfigFile::default();
    let machines: usize = ask.parse("How many machines take part in the job?", "1", positive)?;
    file.num_machines = Some(machines);
    if machines > 1 {
        file.machine_rank = Some(ask.parse(
            "What is this machine's rank (0 for the one that runs rank 0)?",
            "0",
            |n: &usize| {
                (*n < machines)
                    .then_some(())
                    .ok_or("must be below the number of machines")
            },
        )?);
        file.main_process_ip =
            Some(ask.parse("What is the IP address of machine 0?", "127.0.0.1", any)?);
        file.main_process_port = Some(ask.parse(
            "Which port does machine 0 listen on?",
            "29500",
            |p: &u16| {
                (*p > 0)
                    .then_some(())
                    .ok_or("must be a port from 1 to 65535")
            },
        )?);
    }
    file.num_processes = Some(ask.parse(
        "How many processes on this machine (one per GPU)?",
        "1",
        positive,
    )?);
    let cpu: YesNo = ask.parse("Train on the CPU only, even with GPUs present?", "no", any)?;
    file.use_cpu = Some(cpu.0);
    if !cpu.0 {
        let ids: String = ask.parse("Which GPUs (ids such as 0,1, or all)?", "all", any)?;
        file.gpu_ids = (ids != "all").then_some(ids);
    }
    file.mixed_precision = Some(ask.parse("Mixed precision (no, fp16, bf16)?", "no", any)?);
    file.gradient_accumulation_steps = Some(ask.parse(
        "How many micro-batches per optimizer update (gradient accumulation)?",
        "1",
        positive,
    )?);
    Ok(file)
}

fn positive(n: &usize) -> Result<(), &'static str> {
    (*n > 0).then_some(()).ok_or("must be at least 1")
}

fn any<T>(_: &T) -> Result<(), &'static str> {
    Ok(())
}

/// A yes/no answer.
struct YesNo(bool);

impl FromStr for YesNo {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "y" | "yes" | "true" => Ok(Self(true)),
            "n" | "no" | "false" => Ok(Self(false)),
            _ => Err("answer yes or no"),
        }
    }
}

struct Asker<'a, R, W> {
    input: &'a mut R,
    output: &'a mut W,
}

impl<R: BufRead, W: Write> Asker<'_, R, W> {
    /// Asks until the answer parses and passes `check`; Enter takes `default`.
    fn parse<T: FromStr, E: std::fmt::Display>(
        &mut self,
        question: &str,
        default: &str,
        check: impl Fn(&T) -> Result<(), E>,
    ) -> anyhow::Result<T> {
        loop {
            write!(self.output, "{question} [{default}]: ")?;
            self.output.flush()?;
            let mut line = String::new();
            if self.input.read_line(&mut line)? == 0 {
                bail!("the input ended before \"{question}\" was answered; hint: use --default");
            }
            let answer = match line.trim() {
                "" => default,
                answer => answer,
            };
            match answer.parse::<T>() {
                Ok(value) => match check(&value) {
                    Ok(()) => return Ok(value),
                    Err(why) => writeln!(self.output, "  {answer:?} {why}")?,
                },
                Err(_) => writeln!(self.output, "  {answer:?} is not a valid answer")?,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_make_the_file_and_bad_answers_are_asked_again() {
        let answers = "2\n5\n1\n10.0.0.1\n\n4\nmaybe\nno\n0,1\nfp8\nbf16\n\n";
        let mut output = Vec::new();
        let file = ask_all(&mut answers.as_bytes(), &mut output).unwrap();
        assert_eq!(
            file,
            ConfigFile {
                num_machines: Some(2),
                machine_rank: Some(1),
                main_process_ip: Some("10.0.0.1".into()),
                main_process_port: Some(29500),
                num_processes: Some(4),
                use_cpu: Some(false),
                gpu_ids: Some("0,1".into()),
                mixed_precision: Some(MixedPrecision::Bf16),
                gradient_accumulation_steps: Some(1),
                ..ConfigFile::default()
            }
        );
        let asked = String::from_utf8(output).unwrap();
        assert!(
            asked.contains("\"5\" must be below the number of machines"),
            "{asked}"
        );
        assert!(asked.contains("\"maybe\" is not a valid answer"), "{asked}");
        assert!(asked.contains("\"fp8\" is not a valid answer"), "{asked}");
    }

    #[test]
    fn closed_input_is_an_error_that_suggests_default() {
        let err = ask_all(&mut "1\n".as_bytes(), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("--default"), "{err}");
    }
}
