//! `rallypoint.ft.RallyTransport` (issue 47 §2, healing at link speed) under
//! real torch: each case of `tests/py/ft/transport_cases.py` in its own
//! process (round trip, striping over two sources, failover, and every bad
//! input: a step the source does not have, a source killed mid-transfer,
//! truncated and malformed streams, a shape that does not match the model,
//! hostile clients, a silent source, `disallow_checkpoint` mid-transfer or
//! with a transfer stuck past its socket's shutdown, a header naming a huge
//! shape, receivers idling on a future step, a blackholed second source), and
//! `tests/py/ft/transport_manager.py`: a replica healing through it under
//! torchft 0.2.0's own `Manager`, lighthouse and training loop, its state
//! then bitwise equal to its peer's.
//!
//! The scripts run with the `rallypoint` package staged as pip lays it out
//! (`torch_backend::package`); every check is in the script, which exits
//! non-zero with the failed assertion, and prints `PASS`.

use std::process::Command;
use std::time::Duration;

use super::torch_backend::package;
use super::{python, script, Job};

const LIMIT: Duration = Duration::from_secs(180);

/// Runs `tests/py/ft/<name>` with `args`; its output, after checking it ended
/// normally and printed `PASS`.
fn run(name: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Command::new(python());
    c.arg(script(&format!("ft/{name}")))
        .args(args)
        .env("PYTHONPATH", package(dir.path()))
        .env("MASTER_ADDR", "127.0.0.1")
        .env("PYTHONUNBUFFERED", "1");
    let mut job = Job::spawn(c, dir.path(), "script");
    let status = job.wait(LIMIT);
    let out = job.output();
    assert!(status.success(), "{name} {args:?}: {status}\n{out}");
    assert!(
        out.contains("PASS"),
        "{name} {args:?} did not print PASS:\n{out}"
    );
    out
}

fn case(name: &str) -> String {
    let out = run("transport_cases.py", &[name]);
    assert!(out.contains(&format!("PASS {name}")), "{out}");
    out
}

#[test]
fn a_state_dict_with_model_adamw_state_and_non_tensor_leaves_arrives_bitwise_equal() {
    case("roundtrip");
}

#[test]
fn a_receive_is_striped_over_two_sources_each_serving_a_share() {
    let out = case("striped");
    assert!(out.contains("bytes from one source"), "{out}");
}

#[test]
fn sources_that_refuse_or_die_mid_piece_hand_their_pieces_to_the_others() {
    case("failover");
}

/// Under torchft's Manager the receiver asks as soon as the quorum names its
/// source, which stages the step in its own quorum thread: a header request
/// for a step not staged yet waits for it (a refusal there failed the heal
/// of every replica that started second, and torchft's DDP then crashed).
#[test]
fn a_receiver_asking_before_the_step_is_staged_waits_for_it() {
    case("early");
}

#[test]
fn a_step_the_source_does_not_serve_is_refused_naming_what_it_serves() {
    let out = case("wrong_step");
    assert!(out.contains("this source serves step 7"), "{out}");
}

#[test]
fn a_source_killed_mid_transfer_fails_the_receive_naming_it_and_the_tensor() {
    let out = case("died");
    assert!(out.contains("tensor ['user']['default']['t"), "{out}");
}

#[test]
fn a_truncated_or_oversized_chunk_fails_naming_the_source_and_the_tensor() {
    case("truncated");
}

#[test]
fn a_shape_or_dtype_unlike_the_receivers_model_is_refused_before_any_byte_moves() {
    let out = case("mismatch");
    assert!(out.contains("nothing was received"), "{out}");
}

#[test]
fn a_malformed_header_frame_or_spec_is_refused_with_what_is_wrong() {
    case("malformed");
}

#[test]
fn hostile_clients_do_not_harm_other_transfers_and_a_stalled_reader_is_cut() {
    case("hostile");
}

#[test]
fn a_silent_source_times_out_saying_what_was_awaited_and_from_whom() {
    case("timeout");
}

#[test]
fn disallow_checkpoint_mid_transfer_fails_the_receiver_never_mixing_two_steps() {
    case("disallow_midway");
}

/// Review item 3: torchft calls `disallow_checkpoint` in `should_commit`,
/// outside any try; a transfer its socket's shutdown does not end is logged,
/// never raised.
#[test]
fn disallow_checkpoint_never_raises_when_a_transfer_outlives_its_sockets_shutdown() {
    let out = case("stuck_freeze");
    assert!(out.contains("returning anyway"), "{out}");
}

/// Review item 8: no allocation from a header the host cannot hold; JSON
/// booleans are not integers.
#[test]
fn a_header_naming_a_huge_shape_is_refused_before_any_allocation() {
    let out = case("huge_header");
    assert!(out.contains("nothing was allocated"), "{out}");
}

/// Review item 9.
#[test]
fn receivers_waiting_for_a_future_step_do_not_starve_a_receiver_of_the_staged_one() {
    case("idle_meta");
}

/// Review item 10: a silent source's share is served by the others at once.
#[test]
fn a_blackholed_second_source_does_not_delay_a_striped_receive() {
    case("blackholed");
}

#[test]
fn a_late_replica_heals_through_it_under_torchfts_own_manager_bitwise_equal() {
    let out = run("transport_manager.py", &[]);
    assert!(out.contains("bitwise equal on both replicas"), "{out}");
}
