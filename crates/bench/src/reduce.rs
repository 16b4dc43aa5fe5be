//! `rallypoint-bench reduce`: how fast one rank reduces a received segment
//! into its buffer (`Element::reduce`, a sum), per element type, beside a
//! plain copy of the same bytes in the same run: the rate a collective's
//! reduction steps run at, with no transport.

use std::time::Instant;

use anyhow::Result;
use rallypoint_collectives::{bf16, f16, Element, ReduceOp};

#[derive(clap::Args, Clone)]
pub struct ReduceArgs {
    /// Bytes of each buffer (the default is the smallest segment the ring
    /// and chain cut a large buffer into).
    #[arg(long, default_value_t = 256 << 10)]
    bytes: usize,
    /// Bytes reduced per measurement.
    #[arg(long, default_value_t = 1 << 30)]
    total: usize,
}

pub fn run(args: ReduceArgs) -> Result<()> {
    println!(
        "| type | reduce GB/s (of the buffer) | copy GB/s, same bytes | reduce / copy |\n|---|---:|---:|---:|"
    );
    let copy = rate(args.bytes, args.total, |a: &mut [u8], b: &[u8]| {
        a.copy_from_slice(b)
    });
    for (name, r) in [
        ("f32", rate::<f32>(args.bytes, args.total, sum)),
        ("f16", rate::<f16>(args.bytes, args.total, sum)),
        ("bf16", rate::<bf16>(args.bytes, args.total, sum)),
        // What the 16-bit types did before `element/halves.rs`.
        (
            "f16, element by element",
            rate::<f16>(args.bytes, args.total, |a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = f16::from_f32(x.to_f32() + y.to_f32());
                }
            }),
        ),
        (
            "bf16, element by element",
            rate::<bf16>(args.bytes, args.total, |a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x = bf16::from_f32(x.to_f32() + y.to_f32());
                }
            }),
        ),
        ("f64", rate::<f64>(args.bytes, args.total, sum)),
        ("i32", rate::<i32>(args.bytes, args.total, sum)),
    ] {
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            r / 1e9,
            copy / 1e9,
            r / copy
        );
    }
    Ok(())
}

fn sum<T: Element>(a: &mut [T], b: &[T]) {
    T::reduce(ReduceOp::Sum, a, b);
}

/// Bytes of `a` per second through `f(a, b)`, best of five rounds.
fn rate<T: Copy + Default>(bytes: usize, total: usize, f: impl Fn(&mut [T], &[T])) -> f64 {
    let n = (bytes / std::mem::size_of::<T>()).max(1);
    let (mut a, b) = (vec![T::default(); n], vec![T::default(); n]);
    let reps = (total / bytes.max(1)).max(1);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            f(std::hint::black_box(&mut a), std::hint::black_box(&b));
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (n * std::mem::size_of::<T>() * reps) as f64 / best
}
