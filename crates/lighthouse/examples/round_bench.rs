//! The quorum service alone: N simulated members (1,024 by default) in one
//! process, each on its own connection to the service (a tonic channel, as
//! each torchft manager has), all calling `Quorum` every round, as every
//! replica group does at every step. A round's time runs from the moment the
//! round starts (every member's call about to be sent) to the last member's
//! answer; the first round, which forms the quorum, is a warm-up. Prints the
//! median, p90, p99 and the worst round.
//!
//! torchft's protocol answers every member with the whole quorum (about 60
//! bytes a member here, so 1,024 answers of 60 KB: 60 MB a round). The
//! simulated members skip the answer's bytes instead of decoding them (all
//! but member 0, which decodes and checks it), so that the figure is the
//! service's: decoding the requests, the machine, encoding and writing every
//! answer.
//!
//! ```text
//! cargo run --release -p rallypoint-lighthouse --example round_bench [-- MEMBERS ROUNDS]
//! ```
//!
//! The service and the members share the machine's cores here, so a figure
//! is an upper bound on the service's own share.

use std::time::{Duration, Instant};

use rallypoint_lighthouse::proto::{self, LighthouseServiceClient};
use rallypoint_lighthouse::quorum::Knobs;
use rallypoint_lighthouse::service::{Config, Server};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};

/// An answer read past, not decoded: its one field is skipped as unknown.
#[derive(Clone, PartialEq, prost::Message)]
struct Skipped {}

/// The longest one round may take before the benchmark gives up.
const ROUND_LIMIT: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let members: usize = args.next().map_or(1024, |a| a.parse().expect("MEMBERS"));
    let rounds: usize = args.next().map_or(50, |a| a.parse().expect("ROUNDS"));
    let knobs = Knobs {
        // Every member is in every quorum.
        min_replicas: members as u64,
        join_timeout: Duration::from_secs(60),
        quorum_tick: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(60),
    };
    let server = Server::bind("127.0.0.1:0".parse().unwrap(), Config::new(knobs))
        .await
        .expect("bind");
    let addr = server.local_addr().unwrap();
    tokio::spawn(server.run(std::future::pending()));

    let mut clients = Vec::with_capacity(members);
    for _ in 0..members {
        let channel: Channel = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .expect("connect");
        clients.push(channel);
    }
    eprintln!("{members} members connected to {addr}; {rounds} rounds after a warm-up");

    let mut times = Vec::with_capacity(rounds);
    for round in 0..=rounds {
        let t0 = Instant::now();
        let calls: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let c = c.clone();
                tokio::spawn(async move {
                    let mut req = tonic::Request::new(proto::LighthouseQuorumRequest {
                        requester: Some(proto::QuorumMember {
                            replica_id: format!("member_{i:04}"),
                            address: format!("http://127.0.0.1:{}", 10_000 + i),
                            store_address: format!("127.0.0.1:{}", 20_000 + i),
                            step: round as i64,
                            world_size: 1,
                            ..Default::default()
                        }),
                        last_quorum: None,
                    });
                    req.set_timeout(ROUND_LIMIT);
                    if i == 0 {
                        let mut full = LighthouseServiceClient::new(c);
                        let q = full.quorum(req).await.expect("quorum").into_inner();
                        let n = q.quorum.map_or(0, |q| q.participants.len());
                        assert_eq!(n, members, "every member in the quorum");
                    } else {
                        let mut grpc = tonic::client::Grpc::new(c);
                        grpc.ready().await.expect("ready");
                        let codec = tonic_prost::ProstCodec::<_, Skipped>::default();
                        let path = PathAndQuery::from_static("/torchft.LighthouseService/Quorum");
                        grpc.unary(req, path, codec).await.expect("quorum");
                    }
                    Instant::now()
                })
            })
            .collect();
        let mut last = t0;
        for call in calls {
            last = last.max(call.await.unwrap());
        }
        if round > 0 {
            times.push(last - t0);
        }
    }
    times.sort();
    let pct = |p: f64| times[((times.len() as f64 * p).ceil() as usize).clamp(1, times.len()) - 1];
    println!(
        "quorum round, {members} members, {rounds} rounds: median {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        ms(pct(0.5)),
        ms(pct(0.9)),
        ms(pct(0.99)),
        ms(*times.last().unwrap())
    );
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
