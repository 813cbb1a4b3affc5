//! All-reduce bandwidth in the style of nccl-tests: for each transport and world size, a table
//! of size, count, time (median of the timed calls, microseconds), algbw and busbw (GB/s,
//! 1 GB = 1e9 B; busbw = algbw x 2(n-1)/n), and a count of wrong elements from a verified run.
//! The machine's copy bandwidth (STREAM-style: bytes read plus bytes written per second) is
//! measured in the same run and printed beside the tables, with the bound it puts on a
//! shared-memory all-reduce.
//!
//! ```text
//! cargo bench -p accelerate-benches --bench collectives -- [--transports shm,tcp,mpi]
//!     [--worlds 2,3,4] [--dtypes f32,bf16] [--max-size 268435456] [--json results.json]
//! ```
//!
//! `mpi` (a build with `--features mpi`) starts the ranks with Open MPI's `mpirun` and runs
//! our MPI engine; the others start them directly.
//!
//! Over shared memory it also measures `all_reduce_shared`, the in-place all-reduce of a
//! buffer allocated with `ProcessGroup::shared_buffer` (no staging copies).
//!
//! The binary starts copies of itself as the ranks (127.0.0.1 only).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Instant;

use accelerate_core::ProcessState;
use accelerate_core::comm::{GroupOptions, ProcessGroup, Reduction, SharedBuffer};

const CHILD: &str = "ACCELERATE_BENCH_CHILD";
const API: &str = "ACCELERATE_BENCH_API";
const DTYPE: &str = "ACCELERATE_BENCH_DTYPE";

struct Args {
    transports: Vec<String>,
    worlds: Vec<usize>,
    dtypes: Vec<String>,
    min_size: usize,
    max_size: usize,
    json: Option<String>,
}

fn parse_args() -> Args {
    let mut args = Args {
        transports: vec!["shm".into(), "tcp".into()],
        worlds: vec![2, 3, 4],
        dtypes: vec!["f32".into()],
        min_size: 4 << 10,
        max_size: 256 << 20,
        json: None,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--transports" => args.transports = value.split(',').map(str::to_string).collect(),
            "--worlds" => args.worlds = value.split(',').filter_map(|w| w.parse().ok()).collect(),
            "--dtypes" => args.dtypes = value.split(',').map(str::to_string).collect(),
            "--min-size" => args.min_size = value.parse().unwrap_or(args.min_size),
            "--max-size" => args.max_size = value.parse().unwrap_or(args.max_size),
            "--json" => args.json = Some(value),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    args
}

fn sizes(min: usize, max: usize) -> Vec<usize> {
    std::iter::successors(Some(min), |s| Some(s * 4))
        .take_while(|&s| s <= max)
        .collect()
}

/// STREAM-style copy bandwidth with one thread per core: bytes read plus bytes written per
/// second, best of five, in GB/s.
fn copy_bandwidth() -> f64 {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let len = 32 << 20; // f32 elements per thread: 128 MiB, far beyond the caches.
    let mut buffers: Vec<(Vec<f32>, Vec<f32>)> = (0..threads)
        .map(|t| (vec![t as f32; len], vec![0.0; len]))
        .collect();
    let mut best = 0.0_f64;
    for _ in 0..5 {
        let started = Instant::now();
        std::thread::scope(|s| {
            for (src, dst) in buffers.iter_mut() {
                s.spawn(move || dst.copy_from_slice(src));
            }
        });
        let secs = started.elapsed().as_secs_f64();
        best = best.max((2 * 4 * len * threads) as f64 / secs / 1e9);
    }
    best
}

fn commit() -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn main() {
    if std::env::var(CHILD).is_ok() {
        child();
        return;
    }
    let args = parse_args();
    let copy = copy_bandwidth();
    println!(
        "# accelerate-rs all_reduce benchmark (sum), commit {}",
        commit()
    );
    println!(
        "# copy bandwidth (read + write, {} threads): {copy:.1} GB/s; a 2-rank shared-memory \
         all-reduce moves at least 4 bytes per byte reduced, so its busbw bound is {:.1} GB/s",
        std::thread::available_parallelism().map_or(2, |n| n.get()),
        copy / 4.0
    );
    let mut json = Vec::new();
    for transport in &args.transports {
        let apis: &[&str] = if transport == "shm" {
            &["all_reduce", "all_reduce_shared"]
        } else {
            &["all_reduce"]
        };
        for &world in &args.worlds {
            for api in apis {
                for dtype in &args.dtypes {
                    let job = Job {
                        transport,
                        api,
                        dtype,
                        world,
                    };
                    for row in run_job(&job, &sizes(args.min_size, args.max_size)) {
                        json.push(format!(
                            "{{\"transport\":\"{transport}\",\"api\":\"{api}\",\"dtype\":\"{dtype}\",\"world_size\":{world},{row},\"copy_gbps\":{copy:.2}}}"
                        ));
                    }
                }
            }
        }
    }
    if let Some(path) = args.json {
        let body = format!("[\n{}\n]\n", json.join(",\n"));
        if let Err(e) = std::fs::write(&path, body) {
            eprintln!("cannot write {path}: {e}");
        }
    }
}

/// One table: a transport, an API, an element type, a world size.
struct Job<'a> {
    transport: &'a str,
    api: &'a str,
    dtype: &'a str,
    world: usize,
}

/// The command of each rank of `job`: one per rank started directly, or a single `mpirun`
/// for the MPI engine.
fn rank_commands(job: &Job) -> Vec<Command> {
    let exe = std::env::current_exe().expect("the benchmark knows its own path");
    if job.transport == "mpi" {
        let mut mpirun = Command::new("mpirun");
        if std::fs::metadata("/proc/self").is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt;
            m.uid() == 0
        }) {
            mpirun.arg("--allow-run-as-root");
        }
        mpirun
            .args(["--oversubscribe", "-np", &job.world.to_string()])
            .arg(&exe)
            .env("ACCELERATE_TRANSPORT", "mpi");
        return vec![mpirun];
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(29600);
    (0..job.world)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", job.world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", job.world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("ACCELERATE_TRANSPORT", job.transport)
                .env(
                    "ACCELERATE_JOB_TOKEN",
                    format!("bench-{}-{port}", std::process::id()),
                );
            cmd
        })
        .collect()
}

/// Starts the ranks of one job and relays rank 0's table; returns its JSON fields per size.
fn run_job(job: &Job, sizes: &[usize]) -> Vec<String> {
    let size_list: Vec<String> = sizes.iter().map(usize::to_string).collect();
    let mut children: Vec<_> = rank_commands(job)
        .into_iter()
        .enumerate()
        .map(|(i, mut cmd)| {
            cmd.env(CHILD, size_list.join(","))
                .env(API, job.api)
                .env(DTYPE, job.dtype)
                // Only rank 0 prints (under mpirun every rank shares its stdout).
                .stdout(if i == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .spawn()
                .expect("starting a rank")
        })
        .collect();
    let mut rows = Vec::new();
    if let Some(stdout) = children[0].stdout.take() {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            match line.strip_prefix("JSON ") {
                Some(fields) => rows.push(fields.to_string()),
                None => println!("{line}"),
            }
            let _ = std::io::stdout().flush();
        }
    }
    for mut child in children {
        match child.wait() {
            Ok(status) if status.success() => {}
            other => println!("# a rank failed: {other:?}"),
        }
    }
    rows
}

fn child() {
    match std::env::var(DTYPE).as_deref() {
        Ok("bf16") => measure::<half::bf16>("bf16"),
        Ok("f16") => measure::<half::f16>("f16"),
        _ => measure::<f32>("f32"),
    }
}

/// Element types the tables measure (built from f32 with [`accelerate_kernels::Element::from_f32`]).
trait BenchElement: accelerate_kernels::Element + PartialEq {}
impl<T: accelerate_kernels::Element + PartialEq> BenchElement for T {}

/// One rank of a table for element type `T`, named `dtype`.
fn measure<T: BenchElement>(dtype: &str) {
    let sizes: Vec<usize> = std::env::var(CHILD)
        .unwrap_or_default()
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    let state = ProcessState::from_env().expect("launcher variables");
    let options = GroupOptions::from_env().expect("ACCELERATE_* variables");
    let mut group = ProcessGroup::new(&state, &options).expect("the group forms");
    let (rank, n) = (group.rank(), group.world_size());
    let shared = std::env::var(API).is_ok_and(|a| a == "all_reduce_shared");
    let main = rank == 0;
    if main {
        println!();
        println!(
            "# {}, transport {}, world size {n}",
            if shared {
                "all_reduce_shared"
            } else {
                "all_reduce"
            },
            group.transport()
        );
        println!(
            "# {:>10} {:>10} {:>5} {:>5} {:>10} {:>11} {:>11} {:>7}",
            "size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
        );
    }
    for size in sizes {
        let count = size / size_of::<T>();
        let mut buf = if shared {
            Buffer::Shared(group.shared_buffer::<T>(count).expect("shared_buffer"))
        } else {
            Buffer::heap(count)
        };
        // Verified run: rank-dependent integers, exact in every element type here.
        for (i, v) in buf.values().iter_mut().enumerate() {
            *v = T::from_f32(((i + rank) % 7) as f32);
        }
        buf.all_reduce(&mut group);
        let wrong = buf
            .values()
            .iter()
            .enumerate()
            .filter(|&(i, v)| *v != T::from_f32((0..n).map(|r| ((i + r) % 7) as f32).sum::<f32>()))
            .count();
        // Timed runs on zeros (values stay 0, so nothing overflows or turns denormal).
        buf.values().fill(T::from_f32(0.0));
        let iters = ((256 << 20) / size.max(1)).clamp(5, 500);
        for _ in 0..iters.min(20) / 4 + 1 {
            buf.all_reduce(&mut group);
        }
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let started = Instant::now();
            buf.all_reduce(&mut group);
            times.push(started.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let algbw = size as f64 / median / 1e9;
        let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
        let mut wrong_total = [wrong as f32];
        group
            .all_reduce(&mut wrong_total, Reduction::Sum)
            .expect("all_reduce");
        if main {
            println!(
                "  {:>10} {:>10} {:>5} {:>5} {:>10.2} {:>11.3} {:>11.3} {:>7}",
                size,
                count,
                dtype,
                "sum",
                median * 1e6,
                algbw,
                busbw,
                wrong_total[0]
            );
            println!(
                "JSON \"size\":{size},\"count\":{count},\"time_us\":{:.3},\"algbw\":{algbw:.4},\"busbw\":{busbw:.4},\"wrong\":{}",
                median * 1e6,
                wrong_total[0]
            );
        }
    }
    group.barrier().expect("final barrier");
}

/// The buffer under test: `count` elements of a vector, starting on a page boundary as a
/// C program's `calloc` of a large buffer does (so that the comparison with Open MPI's own
/// benchmark is on the same kind of buffer), or one from `ProcessGroup::shared_buffer`.
enum Buffer<T: BenchElement> {
    Heap(Vec<T>, std::ops::Range<usize>),
    Shared(SharedBuffer<T>),
}

impl<T: BenchElement> Buffer<T> {
    fn heap(count: usize) -> Self {
        const PAGE: usize = 4096;
        let v = vec![T::from_f32(0.0); count + PAGE / size_of::<T>()];
        let skip = (PAGE - v.as_ptr() as usize % PAGE) % PAGE / size_of::<T>();
        Buffer::Heap(v, skip..skip + count)
    }

    fn values(&mut self) -> &mut [T] {
        match self {
            Buffer::Heap(v, range) => &mut v[range.clone()],
            Buffer::Shared(b) => b,
        }
    }

    fn all_reduce(&mut self, group: &mut ProcessGroup) {
        match self {
            Buffer::Heap(v, range) => group.all_reduce(&mut v[range.clone()], Reduction::Sum),
            Buffer::Shared(b) => group.all_reduce_shared(b, Reduction::Sum),
        }
        .expect("all_reduce");
    }
}
