//! Registered Rust functions as workers: this binary is both the launcher (running
//! the tests) and, re-executed, the workers.

use std::collections::BTreeMap;
use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};
use rallypoint_elastic::multiprocessing::functions::{dispatch, Registry};
use rallypoint_elastic::multiprocessing::{
    start_processes, Entrypoint, Exit, LogsSpec, PerRank, RunLogs, StartSpec, Std,
};

fn square(args: &[String]) -> Result<Vec<u8>, String> {
    let n: i64 = args
        .first()
        .ok_or("no argument")?
        .parse()
        .map_err(|e| format!("not a number: {e}"))?;
    Ok((n * n).to_string().into_bytes())
}

fn refuse(_: &[String]) -> Result<Vec<u8>, String> {
    Err("refusing on purpose".into())
}

fn explode(args: &[String]) -> Result<Vec<u8>, String> {
    panic!("kaboom with {args:?}");
}

fn run(
    function: &str,
    args: &[&[&str]],
) -> Result<rallypoint_elastic::multiprocessing::RunResult, Failed> {
    let dir = tempfile::tempdir()?;
    let logs = LogsSpec {
        log_dir: Some(dir.path().to_owned()),
        redirects: PerRank::All(Std::All),
        ..LogsSpec::default()
    };
    let spec = StartSpec {
        name: function.into(),
        entrypoint: Entrypoint::Function(function.into()),
        args: args
            .iter()
            .enumerate()
            .map(|(i, a)| (i, a.iter().map(Into::into).collect()))
            .collect(),
        envs: (0..args.len()).map(|i| (i, BTreeMap::new())).collect(),
        global_ranks: BTreeMap::new(),
        bindings: Default::default(),
    };
    let run = RunLogs::create(&logs, "fn")?;
    let mut ctx = start_processes(&spec, &logs, &run.attempt(0, args.len())?)?;
    ctx.wait(Some(Duration::from_secs(30)), Duration::from_millis(2))
        .ok_or_else(|| "workers did not finish".into())
}

fn returns_values() -> Result<(), Failed> {
    let r = run("square", &[&["3"], &["12"], &["-5"]])?;
    assert!(!r.is_failed(), "{:?}", r.failures);
    let values: Vec<&[u8]> = r.return_values.values().map(Vec::as_slice).collect();
    assert_eq!(values, [&b"9"[..], b"144", b"25"]);
    Ok(())
}

fn an_error_is_recorded() -> Result<(), Failed> {
    let r = run("refuse", &[&[]])?;
    let f = &r.failures[&0];
    assert_eq!(f.exit, Exit::Code(1));
    assert_eq!(f.message(), "error: refusing on purpose");
    assert!(r.return_values.is_empty());
    Ok(())
}

fn a_panic_is_recorded() -> Result<(), Failed> {
    let r = run("explode", &[&["a"], &["b"]])?;
    let root = r.root_cause().ok_or("no failure")?;
    assert_eq!(root.exit, Exit::Code(101));
    assert!(
        root.message().starts_with("panic: kaboom with ["),
        "{}",
        root.message()
    );
    Ok(())
}

fn an_unknown_function_is_named() -> Result<(), Failed> {
    let r = run("nope", &[&[]])?;
    let msg = r.failures[&0].message();
    assert!(msg.contains("no worker function named \"nope\""), "{msg}");
    assert!(msg.contains("square"), "lists what exists: {msg}");
    Ok(())
}

fn main() {
    let registry = Registry::new()
        .register("square", square)
        .register("refuse", refuse)
        .register("explode", explode);
    if let Some(code) = dispatch(&registry) {
        std::process::exit(code);
    }
    let tests = vec![
        Trial::test("returns_values", returns_values),
        Trial::test("an_error_is_recorded", an_error_is_recorded),
        Trial::test("a_panic_is_recorded", a_panic_is_recorded),
        Trial::test("an_unknown_function_is_named", an_unknown_function_is_named),
    ];
    libtest_mimic::run(&Arguments::from_args(), tests).exit();
}
