//! `rally`: the rallypoint command line. `main` parses arguments, sets up logging and
//! calls into the libraries.

/// `eprintln!`, written in one `write` (see [`say`]).
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::say(format_args!($($arg)*))
    };
}

mod lighthouse;
mod run;
mod secret;
mod serve;
mod stacks;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "rally",
    version,
    about = "A control plane for distributed jobs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a distributed job: a drop-in for torchrun (same flags, same worker
    /// environment).
    Run(Box<run::RunArgs>),
    /// Print the Python stacks of a running job's workers without stopping
    /// them (a worker's pid, an agent's pid, or a run id).
    Stacks(stacks::StacksArgs),
    /// The quorum service of per-step fault tolerance: a drop-in for
    /// torchft's `torchft_lighthouse` (same flags, same gRPC service).
    Lighthouse(lighthouse::LighthouseArgs),
    /// The key-value store.
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Run a standalone store server speaking PyTorch's TCPStore protocol.
    Serve(serve::ServeArgs),
}

fn main() -> anyhow::Result<()> {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        // Colour only for a person at a terminal, not in Slurm output files.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RALLY_LOG")
                // py-spy narrates every read at info.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,py_spy=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) if args.print_completion.is_some() => {
            print_completion(args.print_completion.as_deref().unwrap_or_default());
            Ok(())
        }
        Command::Run(args) => match run::run(*args) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                say!("rally run: {e:#}");
                std::process::exit(2)
            }
        },
        Command::Stacks(args) => match stacks::run(args) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                say!("rally stacks: {e:#}");
                std::process::exit(2)
            }
        },
        Command::Lighthouse(args) => lighthouse::run(args),
        Command::Store {
            command: StoreCommand::Serve(args),
        } => serve::serve(args),
    }
}

/// `rally run --print-completion SHELL`: a completion script for `rally` (all
/// subcommands) on stdout, as `torchrun --print-completion` prints torchrun's.
fn print_completion(shell: &str) {
    use clap::CommandFactory;
    use clap_complete::Shell;
    let mut cmd = Cli::command();
    let mut out = std::io::stdout();
    let shell = match shell {
        "bash" => Shell::Bash,
        "zsh" => Shell::Zsh,
        "fish" => Shell::Fish,
        "elvish" => Shell::Elvish,
        "powershell" => Shell::PowerShell,
        // clap_complete has no tcsh; its `complete` builtin takes word lists.
        _ => {
            cmd.build();
            let words = |c: &clap::Command| {
                c.get_arguments()
                    .flat_map(|a| a.get_long_and_visible_aliases().unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let subs: Vec<&str> = cmd.get_subcommands().map(|c| c.get_name()).collect();
            let run = cmd.find_subcommand("run").map(words).unwrap_or_default();
            println!("complete rally 'p/1/({})/' 'c/--/({run})/'", subs.join(" "));
            return;
        }
    };
    clap_complete::generate(shell, &mut cmd, "rally", &mut out);
}

/// Writes one line to stderr in one `write`. The workers share the
/// launcher's stderr (inherited), and `eprintln!` writes each formatted
/// piece separately, so a worker's line could land inside one of ours (seen
/// in CI: "rally run: round 0 formed: node err-1"); a single write of a
/// line (under `PIPE_BUF`, 4 KiB, on a pipe) is never split.
pub(crate) fn say(args: std::fmt::Arguments) {
    use std::io::Write;
    let mut line = args.to_string();
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
