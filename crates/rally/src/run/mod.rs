//! `rally run`: torchrun's command line on the rallypoint agent.
//!
//! Every torchrun flag is accepted in both spellings (`--nproc-per-node`,
//! `--nproc_per_node`) with its `PET_*` environment default, and means what it
//! means to torchrun. The flags become an [`AgentSpec`] and rendezvous
//! parameters; the agent does the rest. Exit codes: 0 success, 1 the job failed,
//! 2 bad command line, 3 the rendezvous failed, 4 the agent could not run the
//! workers, 128 + N stopped by signal N.
//!
//! [`run`] goes through it in order: the flags ([`args`]) become a checked
//! [`plan`] (its [`rendezvous`] half, the workers' [`entrypoint`], their
//! [`numa_binding`]); a watchdog process is forked before any thread starts;
//! the rendezvous handler is created; the agent runs the workers while the
//! [`console`] prints its events; at the end the [`report`] says how it
//! went, and the [`error_file`] is written for a scheduler that asked.
//! With `--ft` the run is one replica group of a fault-tolerant job: the
//! group's manager (and, if asked, the lighthouse) runs here ([`ft`]).
//!
//! [`AgentSpec`]: rallypoint_elastic::agent::AgentSpec

mod args;
mod console;
mod entrypoint;
mod error_file;
mod ft;
mod numa_binding;
mod plan;
mod rendezvous;
mod report;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rallypoint_elastic::agent::events::{EventSink, Fanout};
use rallypoint_elastic::agent::{status, Agent, Outcome};
use rallypoint_elastic::multiprocessing::watchdog;
use rallypoint_rendezvous::registry::Registry;
use rallypoint_rendezvous::{RendezvousError, RendezvousHandler};
use tokio::runtime::Runtime;

pub use args::RunArgs;
use plan::Plan;

/// Runs the job; returns the process exit code.
pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    let plan = plan::plan(&a)?;
    let ft_plan = ft::plan(&a, plan.max_nodes)?;
    a.secret.apply("rally run")?;
    set_worker_environment(&a, &plan);
    // Kills every descendant of the workers if this process dies, SIGKILL
    // included (see the watchdog module). Released once the agent has swept;
    // on an early return it is dropped, and so told to sweep.
    let mark = plan.spec.mark.clone().unwrap_or_default();
    // SAFETY: no thread has been started yet (the runtime comes next).
    let watchdog = unsafe { watchdog::fork(&mark) };

    // One runtime thread keeps the hosted store, heartbeats and the status server
    // going while this thread watches the workers.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let handler = match create_handler(&rt, &plan) {
        Ok(h) => h,
        Err(e) => {
            say!(
                "rally run: cannot set up the {:?} rendezvous: {}",
                plan.params.backend,
                report::chain(&e)
            );
            return Ok(Outcome::Rendezvous(e).exit_code());
        }
    };
    console::announce(&plan);
    let events = console::sinks(&a)?;
    let ft = match ft_plan {
        Some(p) => match ft::Ft::start(&rt, p, plan.spec.local_world_size) {
            Ok(ft) => Some(ft),
            Err(e) => {
                say!("rally run: {e:#}");
                return Ok(Outcome::Error(format!("{e:#}")).exit_code());
            }
        },
        None => None,
    };
    let events = match &ft {
        Some(ft) => {
            ft.forward_events(&rt, events.clone());
            Arc::new(Fanout(vec![ft.agent_hook(&rt), events])) as Arc<dyn EventSink>
        }
        None => events,
    };
    let agent = Agent::new(plan.spec, handler).with_events(events);
    if let Some(ft) = &ft {
        ft.stop_when_refused(&rt, agent.stopper());
    }
    if let Some(port) = a.status_port {
        let sections = ft.iter().map(ft::Ft::section).collect();
        serve_status(&rt, port, &agent, sections)?;
    }
    // On this thread: the workers' parent-death signal follows it.
    let mut outcome = rt.block_on(agent.run());
    if let (Some(reason), Outcome::Signaled { .. }) =
        (ft.as_ref().and_then(ft::Ft::refused), &outcome)
    {
        // The stop was ours (the agent's Stopper), not a user's signal.
        outcome = Outcome::Error(format!("--ft: {reason}"));
    }
    match watchdog {
        // The agent swept its marked processes at the end of its last round.
        Ok(w) => w.release(),
        Err(e) => {
            tracing::warn!(error = %e, "there was no watchdog: descendants of workers could have outlived a killed agent")
        }
    }
    finish(&outcome, &a);
    if let Some(ft) = ft {
        say!("{}", ft.summary());
        ft.shutdown(&rt);
    }
    let code = outcome.exit_code();
    // Do not wait for background tasks (heartbeats, the hosted store).
    rt.shutdown_timeout(Duration::from_millis(100));
    Ok(code)
}

/// The variables workers inherit from rally, as under torchrun.
fn set_worker_environment(a: &RunArgs, plan: &Plan) {
    if plan.spec.local_world_size > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        say!("rally run: setting OMP_NUM_THREADS=1 for each worker (set it yourself to tune)");
        std::env::set_var("OMP_NUM_THREADS", "1");
    }
    std::env::set_var("TORCHELASTIC_SIGNALS_TO_HANDLE", &a.signals_to_handle);
}

/// The handler of the planned rendezvous backend, from the built-in registry.
fn create_handler(
    rt: &Runtime,
    plan: &Plan,
) -> Result<Arc<dyn RendezvousHandler>, RendezvousError> {
    let registry = Registry::with_builtins();
    rt.block_on(registry.create_handler(plan.params.clone()))
        .map(Arc::<dyn RendezvousHandler>::from)
}

/// `--status-port`: /status and /metrics of the agent (and `sections`),
/// said on the console.
fn serve_status(
    rt: &Runtime,
    port: u16,
    agent: &Agent,
    sections: Vec<Arc<dyn status::Section>>,
) -> anyhow::Result<()> {
    let addr = SocketAddr::from(([0, 0, 0, 0], port));
    let bound = rt
        .block_on(status::serve_with(addr, agent.status(), sections))
        .with_context(|| format!("--status-port {port}"))?;
    say!("rally run: status at http://{bound}/status, metrics at /metrics");
    Ok(())
}

/// After the run: the summary, a hint when a Python worker's failure points
/// at the wrong interpreter, and the launcher's error file.
fn finish(outcome: &Outcome, a: &RunArgs) {
    report::report(outcome, &report::script_name(a));
    if let (
        Outcome::Failed {
            root_cause: Some(root),
            ..
        },
        true,
    ) = (outcome, entrypoint::runs_python(a))
    {
        if let Some(hint) = entrypoint::interpreter_hint(root) {
            say!("{hint}");
        }
    }
    if let Err(e) = error_file::write_launcher_error_file(outcome) {
        say!("rally run: {e:#}");
    }
}
