//! `rally`: the rallypoint command line. `main` parses arguments, sets up logging and
//! calls into the libraries.

/// `eprintln!`, written in one `write` (see [`say`]).
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::say(format_args!($($arg)*))
    };
}

mod run;
mod stacks;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use rallypoint_store::protocol::Limits;
use rallypoint_store::server::{Server, ServerConfig};

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
    /// The key-value store.
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Run a standalone store server speaking PyTorch's TCPStore protocol.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to listen on; `::` (the default) also accepts IPv4 (dual-stack).
    #[arg(long, default_value = "::")]
    host: IpAddr,
    /// Port to listen on; 0 picks a free one. The bound address is printed.
    #[arg(long, default_value_t = 29500)]
    port: u16,
    /// Longest key accepted, in bytes.
    #[arg(long, default_value_t = Limits::default().max_key_len)]
    max_key_len: u64,
    /// Longest value accepted, in bytes.
    #[arg(long, default_value_t = Limits::default().max_value_len)]
    max_value_len: u64,
    /// Worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
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
        Command::Store {
            command: StoreCommand::Serve(args),
        } => serve(args),
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

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // One thread means one thread: a current-thread runtime keeps the I/O driver
    // and the connection tasks together, with no hand-off between threads.
    let mut rt = match args.threads {
        Some(0 | 1) => tokio::runtime::Builder::new_current_thread(),
        Some(n) => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            b.worker_threads(n);
            b
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let rt = rt
        .enable_all()
        .build()
        .context("failed to start the runtime")?;
    rt.block_on(async move {
        let config = ServerConfig {
            limits: Limits {
                max_key_len: args.max_key_len,
                max_value_len: args.max_value_len,
                ..Limits::default()
            },
            shutdown_grace: Duration::from_secs(5),
            ..ServerConfig::default()
        };
        let addr = SocketAddr::new(args.host, args.port);
        let server = Server::bind(addr, config)
            .await
            .with_context(|| format!("failed to listen on {addr}"))?;
        // Scripts read this line to learn the port.
        println!("rally store listening on {}", server.local_addr());
        let handle = server.spawn();
        handle.run_until(shutdown_signal()).await;
        tracing::info!("store server stopped");
        anyhow::Ok(())
    })
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
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
