use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use common::env_contract::WorkerEnv;

use super::*;

const CTX: OpContext = OpContext {
    step: 0,
    timeout: Duration::from_secs(20),
};

use super::test_ring::{with_hosts, with_ring, with_ring_opts};

const SOCKETS_ONLY: TcpOptions = TcpOptions {
    shared_memory: false,
};

/// Someone who found rank 0's ring port (here: from the store) and claims to be rank 1
/// connects first and offers huge values; rank 0 drops it and the sum is the ranks' own.
#[test]
fn a_stranger_claiming_a_rank_is_refused() {
    use crate::store::StoreServer;
    let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "ring-auth").unwrap();
    let addr = server.local_addr();
    let env = |rank| WorkerEnv::single_node(rank, 2, "127.0.0.1", addr.port(), "ring-auth");
    let store =
        || StoreClient::connect(&addr.to_string(), "ring-auth", Duration::from_secs(10)).unwrap();
    let mut spy = store();
    let stranger = std::thread::spawn(move || {
        let target = spy.wait(&["tcp/peer/0"], Duration::from_secs(10)).unwrap();
        // The nonce (32 bytes), then the address.
        let target: SocketAddr = String::from_utf8_lossy(&target[0][32..]).parse().unwrap();
        let mut sock = TcpStream::connect(target).unwrap();
        let mut greeting = 1u64.to_le_bytes().to_vec();
        greeting.extend_from_slice(&[0u8; 32]);
        sock.write_all(&greeting).unwrap();
        let _ = sock.write_all(&vec![0x7f; 4096]);
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // Dropped by rank 0: EOF or a reset, never data.
        let mut buf = [0u8; 64];
        matches!(sock.read(&mut buf), Ok(0) | Err(_))
    });
    let ranks: Vec<_> = (0..2u32)
        .map(|rank| {
            let (env, store) = (env(rank), store());
            std::thread::spawn(move || {
                if rank == 1 {
                    std::thread::sleep(Duration::from_millis(500));
                }
                let mut comm =
                    TcpCollective::connect(&env, store, Duration::from_secs(10)).unwrap();
                let mut t = [Tensor::from_slice(&[1.0f32; 4])];
                comm.all_reduce(&mut t, ReduceOp::Sum, CTX).unwrap();
                t[0].double_value(&[0])
            })
        })
        .collect();
    for r in ranks {
        assert_eq!(r.join().unwrap(), 2.0);
    }
    assert!(stranger.join().unwrap(), "the stranger got an answer");
    drop(server);
}

/// Small integers, so that every summation order gives the exact same float.
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 7 + i * 3) % 23) as f32 - 11.0
}

#[test]
fn all_reduce_matches_a_direct_sum_for_every_world_and_length() {
    for (world, shared_memory) in (1..=5u32).flat_map(|w| [(w, true), (w, false)]) {
        let options = TcpOptions { shared_memory };
        for len in [0usize, 1, 2, 3, 4, 5, 7, 1000, 10_007, 300_001] {
            let results = with_ring_opts(world, options, move |rank, comm| {
                assert_eq!(comm.uses_shared_memory(), shared_memory && world > 1);
                let data: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                let mut t = [Tensor::from_slice(&data)];
                comm.all_reduce(&mut t, ReduceOp::Sum, CTX).unwrap();
                Vec::<f32>::try_from(&t[0]).unwrap()
            });
            let expected: Vec<f32> = (0..len)
                .map(|i| (0..world as usize).map(|r| value(r, i)).sum())
                .collect();
            for (rank, got) in results.iter().enumerate() {
                assert_eq!(
                    got, &expected,
                    "world {world}, length {len}, rank {rank}, {options:?}"
                );
            }
        }
    }
}

/// Several hosts of several ranks: all-reduce sums inside each host through shared memory,
/// between hosts over the leaders' ring; every rank gets the direct sum, and the other
/// operations (on the job's ring) still line up with it.
#[test]
fn hierarchical_all_reduce_matches_a_direct_sum() {
    for (hosts, per_host) in [(2u32, 2u32), (3, 2), (2, 3)] {
        let world = (hosts * per_host) as usize;
        for len in [0usize, 1, 5, 10_007, 300_001] {
            let results = with_hosts(hosts, per_host, TcpOptions::default(), move |rank, comm| {
                assert_eq!(
                    comm.name(),
                    "tcp (shared memory in each host, ring between hosts)"
                );
                let data: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                let mut t = [Tensor::from_slice(&data)];
                comm.all_reduce(&mut t, ReduceOp::Sum, CTX).unwrap();
                let gathered = comm
                    .all_gather(&Tensor::from_slice(&[rank as f32]), CTX)
                    .unwrap();
                comm.barrier(CTX).unwrap();
                let gathered: Vec<f64> = gathered.iter().map(|g| g.double_value(&[0])).collect();
                (Vec::<f32>::try_from(&t[0]).unwrap(), gathered)
            });
            let expected: Vec<f32> = (0..len)
                .map(|i| (0..world).map(|r| value(r, i)).sum())
                .collect();
            let ranks: Vec<f64> = (0..world).map(|r| r as f64).collect();
            for (rank, (got, gathered)) in results.iter().enumerate() {
                let case = format!("{hosts} hosts x {per_host}, length {len}, rank {rank}");
                assert_eq!(got, &expected, "{case}");
                assert_eq!(gathered, &ranks, "{case}");
            }
        }
    }
}

/// Without shared memory, or with one rank per host, several hosts use the plain ring.
#[test]
fn several_hosts_without_shared_memory_use_the_ring() {
    for (per_host, options) in [(2, SOCKETS_ONLY), (1, TcpOptions::default())] {
        let results = with_hosts(2, per_host, options, |rank, comm| {
            let mut t = [Tensor::from_slice(&[rank as f32 + 1.0])];
            comm.all_reduce(&mut t, ReduceOp::Avg, CTX).unwrap();
            (comm.name(), t[0].double_value(&[0]))
        });
        let world = 2 * per_host as usize;
        let mean = (1..=world).sum::<usize>() as f64 / world as f64;
        for (name, got) in results {
            assert_eq!(
                (name, got),
                ("tcp", mean),
                "{per_host} per host, {options:?}"
            );
        }
    }
}

#[test]
fn average_of_many_tensors_of_mixed_kinds() {
    let results = with_ring(3, |rank, comm| {
        let mut tensors = [
            Tensor::from_slice(&[rank as f32; 5]).view([5]),
            Tensor::from_slice(&[2.0 * rank as f32; 6]).view([2, 3]),
            Tensor::from_slice(&[rank as f32 * 3.0]).to_kind(Kind::BFloat16),
        ];
        comm.all_reduce(&mut tensors, ReduceOp::Avg, CTX).unwrap();
        tensors
            .iter()
            .map(|t| Vec::<f32>::try_from(&t.to_kind(Kind::Float).reshape([-1])).unwrap())
            .collect::<Vec<_>>()
    });
    for r in results {
        assert_eq!(r[0], vec![1.0; 5]);
        assert_eq!(r[1], vec![2.0; 6]);
        assert_eq!(r[2], vec![3.0]);
    }
}

/// Broadcast from every root, all-gather and barrier, through shared memory and through the
/// ring, with tensors of several kinds, empty ones, and ones larger than a chunk; a lagging rank
/// and all-reduces in between keep the operations in step.
#[test]
fn broadcast_from_each_root_and_all_gather() {
    let big = 3 * PIECE_BYTES / 4 + 5; // floats: more than one chunk of either path
    for (world, shared_memory) in [(2u32, true), (3, true), (4, true), (4, false)] {
        let options = TcpOptions { shared_memory };
        for root in 0..world as usize {
            let results = with_ring_opts(world, options, move |rank, comm| {
                assert_eq!(comm.uses_shared_memory(), shared_memory);
                if rank == (root + 1) % world as usize {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let mut t = [
                    Tensor::from_slice(&[rank as i64, 10 + rank as i64]),
                    Tensor::from_slice(&vec![rank as f32; big]),
                    Tensor::from_slice::<f32>(&[]),
                ];
                comm.broadcast(&mut t, root, CTX).unwrap();
                let mut sum = [Tensor::from_slice(&[rank as f32])];
                comm.all_reduce(&mut sum, ReduceOp::Sum, CTX).unwrap();
                let gathered = comm
                    .all_gather(&Tensor::from_slice(&[rank as f32, -(rank as f32)]), CTX)
                    .unwrap();
                let long: Vec<i32> = (0..big as i32).map(|i| i * 5 + rank as i32).collect();
                let long = comm.all_gather(&Tensor::from_slice(&long), CTX).unwrap();
                // Into tensors the caller keeps, one of them not contiguous (a column).
                let mine = Tensor::from_slice(&[rank as f32, -(rank as f32)]);
                let column = Tensor::zeros([2, 2], (tch::Kind::Float, tch::Device::Cpu));
                let mut into: Vec<Tensor> = (0..world)
                    .map(|r| match r {
                        0 => column.select(1, 1),
                        _ => mine.zeros_like(),
                    })
                    .collect();
                comm.all_gather_into(&mine, &mut into, CTX).unwrap();
                let wrong = comm.all_gather_into(&mine, &mut into[1..], CTX);
                assert!(
                    wrong.unwrap_err().to_string().contains("needs"),
                    "a short output"
                );
                let into_values: Vec<Vec<f32>> = into
                    .iter()
                    .map(|g| Vec::<f32>::try_from(g).unwrap())
                    .collect();
                assert_eq!(
                    Vec::<f32>::try_from(column.select(1, 1)).unwrap(),
                    into_values[0]
                );
                comm.barrier(CTX).unwrap();
                (
                    Vec::<i64>::try_from(&t[0]).unwrap(),
                    into_values,
                    Vec::<f32>::try_from(&t[1]).unwrap(),
                    sum[0].double_value(&[0]),
                    gathered
                        .iter()
                        .map(|g| Vec::<f32>::try_from(g).unwrap())
                        .collect::<Vec<_>>(),
                    long.iter()
                        .map(|g| Vec::<i32>::try_from(g).unwrap())
                        .collect::<Vec<_>>(),
                )
            });
            let w = world as usize;
            for (ints, into, floats, sum, gathered, long) in results {
                assert_eq!(ints, vec![root as i64, 10 + root as i64]);
                assert!(floats == vec![root as f32; big], "root {root}");
                assert_eq!(sum, (0..w).sum::<usize>() as f64);
                let expect: Vec<Vec<f32>> = (0..w).map(|r| vec![r as f32, -(r as f32)]).collect();
                assert_eq!(gathered, expect);
                assert_eq!(into, expect);
                for (r, part) in long.iter().enumerate() {
                    let want: Vec<i32> = (0..big as i32).map(|i| i * 5 + r as i32).collect();
                    assert!(*part == want, "world {world}: rank {r}'s part");
                }
            }
        }
    }
}

/// Broadcasts and all-gathers whose output outgrows the caches (written with streaming stores
/// through shared memory) arrive exactly, with a part that does not start on 16 bytes, and an
/// all-gather in place.
#[test]
fn large_broadcasts_and_all_gathers_arrive_exactly() {
    let n = (20 << 20) / 4 + 3; // 20 MiB of f32 and a bit: 40 MiB gathered
    let value = |rank: usize, i: usize| (i * 3 + rank) as f32;
    let results = with_ring(2, move |rank, comm| {
        assert!(comm.uses_shared_memory());
        let mine: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
        let whole = Tensor::from_slice(&mine);
        let mut t = [whole.narrow(0, 1, n as i64 - 1), Tensor::from_slice(&mine)];
        comm.broadcast(&mut t, 1, CTX).unwrap();
        let fresh = Tensor::from_slice(&mine); // `whole` now holds the root's values
        let gathered = comm
            .all_gather(&fresh.narrow(0, 1, n as i64 - 1), CTX)
            .unwrap();
        // In place: our part is already our slot of the output (as FSDP gathers).
        let mut into: Vec<Tensor> = (0..2).map(|_| fresh.zeros_like()).collect();
        into[rank].copy_(&fresh);
        let slot = into[rank].shallow_clone();
        comm.all_gather_into(&slot, &mut into, CTX).unwrap();
        let as_vec = |t: &Tensor| Vec::<f32>::try_from(t).unwrap();
        (
            as_vec(&t[0]),
            as_vec(&t[1]),
            gathered.iter().map(as_vec).collect::<Vec<_>>(),
            into.iter().map(as_vec).collect::<Vec<_>>(),
        )
    });
    for (offset, second, gathered, in_place) in results {
        for (r, part) in in_place.iter().enumerate() {
            assert!(
                part.iter().enumerate().all(|(i, v)| *v == value(r, i)),
                "in place, part {r}"
            );
        }
        assert!(offset
            .iter()
            .enumerate()
            .all(|(i, v)| *v == value(1, i + 1)));
        assert!(second.iter().enumerate().all(|(i, v)| *v == value(1, i)));
        for (r, part) in gathered.iter().enumerate() {
            assert_eq!(part.len(), n - 1);
            assert!(
                part.iter().enumerate().all(|(i, v)| *v == value(r, i + 1)),
                "part {r}"
            );
        }
    }
}

/// Ranks that disagree on a broadcast's root are told so, through shared memory too.
#[test]
fn a_broadcast_from_different_roots_is_reported() {
    let results = with_ring(2, |rank, comm| {
        let mut t = [Tensor::from_slice(&[1.0f32; 8])];
        let ctx = OpContext {
            timeout: Duration::from_secs(5),
            ..CTX
        };
        comm.broadcast(&mut t, rank, ctx).map_err(|e| e.to_string())
    });
    for result in results {
        let text = result.unwrap_err();
        assert!(text.contains("disagree"), "{text}");
        assert!(
            text.contains("broadcast from member 0") && text.contains("broadcast from member 1"),
            "{text}"
        );
    }
}

/// Many operations in a row of several chunks each: buffers are reused only when every
/// rank is done with them, and a rank that lags (here: sleeps) gets the right sums.
#[test]
fn shared_memory_keeps_consecutive_operations_apart() {
    let per_chunk = super::super::shm::CHUNK_BYTES / 4;
    let results = with_ring(3, move |rank, comm| {
        assert!(comm.uses_shared_memory());
        let mut sums = Vec::new();
        for op in 0..8usize {
            if rank == op % 3 {
                std::thread::sleep(Duration::from_millis(20));
            }
            let len = per_chunk * (1 + op % 3) + op * 17;
            let data: Vec<f32> = (0..len).map(|i| value(rank + op, i)).collect();
            let mut t = [Tensor::from_slice(&data)];
            comm.all_reduce(&mut t, ReduceOp::Sum, CTX).unwrap();
            sums.push(Vec::<f32>::try_from(&t[0]).unwrap());
        }
        sums
    });
    for op in 0..8usize {
        let len = per_chunk * (1 + op % 3) + op * 17;
        let expected: Vec<f32> = (0..len)
            .map(|i| (0..3).map(|r| value(r + op, i)).sum())
            .collect();
        for (rank, sums) in results.iter().enumerate() {
            assert!(sums[op] == expected, "operation {op}, rank {rank}");
        }
    }
}

/// Buckets of several tensors go through the shared arena: every world and length, arenas
/// replaced by bigger ones, a lagging rank, mixed with single tensors (the chunked path) and
/// mixed kinds; every rank gets the direct sum, exactly as the socket ring gives it.
#[test]
fn buckets_reduced_in_the_shared_arena_match_the_direct_sum_and_the_ring() {
    let per_chunk = super::super::shm::CHUNK_BYTES / 4;
    let lens = [1usize, 3, 1000, per_chunk + 5, 17, 4 * per_chunk + 3, 2];
    for world in [2u32, 3, 4] {
        for options in [TcpOptions::default(), SOCKETS_ONLY] {
            let results = with_ring_opts(world, options, move |rank, comm| {
                let mut sums = Vec::new();
                for (op, len) in lens.into_iter().enumerate() {
                    if rank == op % world as usize {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    let data: Vec<f32> = (0..len).map(|i| value(rank + op, i)).collect();
                    let head = Tensor::from_slice(&data[..len / 2]);
                    let tail = Tensor::from_slice(&data[len / 2..]).to_kind(Kind::Double);
                    let mut bucket = [head, tail];
                    comm.all_reduce(&mut bucket, ReduceOp::Sum, CTX).unwrap();
                    let mut single = [Tensor::from_slice(&data)];
                    comm.all_reduce(&mut single, ReduceOp::Sum, CTX).unwrap();
                    let tail = bucket[1].to_kind(Kind::Float);
                    let joined = Tensor::cat(&[&bucket[0], &tail], 0);
                    sums.push(Vec::<f32>::try_from(&joined).unwrap());
                    sums.push(Vec::<f32>::try_from(&single[0]).unwrap());
                }
                sums
            });
            for (op, len) in lens.into_iter().enumerate() {
                let expected: Vec<f32> = (0..len)
                    .map(|i| (0..world as usize).map(|r| value(r + op, i)).sum())
                    .collect();
                for (rank, sums) in results.iter().enumerate() {
                    let case = format!("world {world}, length {len}, rank {rank}, {options:?}");
                    assert!(sums[2 * op] == expected, "bucket: {case}");
                    assert!(sums[2 * op + 1] == expected, "single tensor: {case}");
                }
            }
        }
    }
}

/// Several hosts: a bucket is summed in each host's arena, then between the hosts.
#[test]
fn hierarchical_buckets_match_the_direct_sum() {
    let results = with_hosts(2, 2, TcpOptions::default(), |rank, comm| {
        let data: Vec<f32> = (0..10_007).map(|i| value(rank, i)).collect();
        let mut bucket = [
            Tensor::from_slice(&data[..5]),
            Tensor::from_slice(&data[5..]),
        ];
        comm.all_reduce(&mut bucket, ReduceOp::Avg, CTX).unwrap();
        Vec::<f32>::try_from(&Tensor::cat(&bucket, 0)).unwrap()
    });
    let expected: Vec<f32> = (0..10_007)
        .map(|i| (0..4).map(|r| value(r, i)).sum::<f32>() / 4.0)
        .collect();
    for (rank, got) in results.iter().enumerate() {
        assert!(got == &expected, "rank {rank}");
    }
}

/// A rank reducing in its arena while another reduces through the chunked path is told so,
/// not given a wrong sum.
#[test]
fn an_arena_operation_against_a_chunked_one_is_reported() {
    let results = with_ring(2, |rank, comm| {
        let ctx = OpContext {
            step: 4,
            timeout: Duration::from_secs(5),
        };
        let mut pair = [
            Tensor::from_slice(&[1.0f32; 2]),
            Tensor::from_slice(&[1.0f32; 2]),
        ];
        comm.all_reduce(&mut pair, ReduceOp::Sum, ctx).unwrap();
        let outcome = if rank == 0 {
            comm.all_reduce(&mut pair, ReduceOp::Sum, ctx)
        } else {
            comm.all_reduce(&mut [Tensor::from_slice(&[1.0f32; 4])], ReduceOp::Sum, ctx)
        };
        outcome.err().map(|e| e.to_string())
    });
    for message in results {
        let message = message.expect("an error on every rank");
        assert!(message.contains("at step 4: ranks disagree"), "{message}");
    }
}

/// Once the group and its arenas are set up, no segment of ours is left in /dev/shm (nothing to leak
/// however the process ends).
#[test]
fn shared_memory_segments_are_unlinked_once_mapped() {
    let ours = format!("{}{}-", common::shm_segments::PREFIX, std::process::id());
    let left = with_ring(2, move |_, comm| {
        assert!(comm.uses_shared_memory());
        let mut bucket = [
            Tensor::from_slice(&[1.0f32; 4]),
            Tensor::from_slice(&[2.0f32]),
        ];
        comm.all_reduce(&mut bucket, ReduceOp::Sum, CTX).unwrap(); // sets up the arenas
        let left: Vec<String> = std::fs::read_dir(common::shm_segments::DIR)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&ours))
            .collect();
        let mut t = [Tensor::from_slice(&[1.0f32; 4])];
        comm.all_reduce(&mut t, ReduceOp::Sum, CTX).unwrap();
        left
    });
    // Other tests of this process may be setting up groups at the same moment: a name seen
    // here must be gone a moment later.
    std::thread::sleep(Duration::from_millis(500));
    for name in left.into_iter().flatten() {
        let path = std::path::Path::new(common::shm_segments::DIR).join(&name);
        assert!(!path.exists(), "{name} is still in /dev/shm");
    }
}

#[test]
fn shared_memory_reports_a_length_mismatch() {
    let results = with_ring(2, |rank, comm| {
        let mut t = [Tensor::from_slice(&vec![1.0f32; 4 + rank])];
        let ctx = OpContext {
            step: 9,
            timeout: Duration::from_secs(5),
        };
        comm.all_reduce(&mut t, ReduceOp::Sum, ctx)
            .err()
            .map(|e| e.to_string())
    });
    for message in results {
        let message = message.expect("an error on every rank");
        assert!(message.contains("at step 9: ranks disagree"), "{message}");
    }
}

#[test]
fn mismatched_operations_are_reported() {
    let results = with_ring_opts(2, SOCKETS_ONLY, |rank, comm| {
        let mut t = [Tensor::from_slice(&[1.0f32; 4])];
        let ctx = OpContext {
            step: 5,
            timeout: Duration::from_secs(5),
        };
        if rank == 0 {
            comm.all_reduce(&mut t, ReduceOp::Sum, ctx)
                .err()
                .map(|e| e.to_string())
        } else {
            comm.broadcast(&mut t, 0, ctx).err().map(|e| e.to_string())
        }
    });
    let message = results.into_iter().flatten().next().expect("an error");
    assert!(message.contains("at step 5: ranks disagree"), "{message}");
}

/// Values whose sums depend on the order they are added in (magnitudes 1e-3 to 1e5), so that
/// "the same bits" means the same reduction order.
fn uneven(rank: usize, i: usize) -> f32 {
    let x = ((rank * 7919 + i * 104_729) % 1_000_003) as f32 / 1_000_003.0;
    (x - 0.5) * 10f32.powi(((rank + i) % 9) as i32 - 3)
}

/// `reduce_scatter` leaves each rank's shard exactly as `all_reduce` would, the shards
/// partition the buffer, and `all_gather_shards` after it (with everything outside the shard
/// overwritten) gives `all_reduce`'s result bit for bit: over the ring alone (its own halves),
/// through shared memory (its own) and across hosts (the default), at every world, for sizes
/// the world does not divide (one chunk of shared memory and several), summed and averaged.
/// On one host the reduce-scatter is the backend's own: it hands the others less than the
/// all-reduce does.
#[test]
fn reduce_scatter_then_all_gather_shards_is_all_reduce_bit_for_bit() {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    type Run =
        Box<dyn Fn(Box<dyn Fn(usize, &mut TcpCollective) -> Check + Send + Sync>) -> Vec<Check>>;
    type Check = (
        Vec<u32>,
        Vec<u32>,
        std::ops::Range<usize>,
        Vec<u32>,
        (u64, u64),
    );
    let setups: Vec<(String, Run)> = [1u32, 2, 3, 4]
        .into_iter()
        .flat_map(|w| {
            [false, true].map(move |shared_memory| {
                let run: Run = Box::new(move |body| {
                    with_ring_opts(w, TcpOptions { shared_memory }, move |r, c| body(r, c))
                });
                (format!("world {w}, shared memory {shared_memory}"), run)
            })
        })
        .chain(std::iter::once({
            let run: Run =
                Box::new(|body| with_hosts(2, 2, TcpOptions::default(), move |r, c| body(r, c)));
            ("2 hosts x 2".to_string(), run)
        }))
        .collect();
    for (name, run) in &setups {
        for (len, op) in [
            (1001usize, ReduceOp::Sum),
            (10_007, ReduceOp::Avg),
            (3, ReduceOp::Sum),
            // Several chunks of the shared-memory path (1 MiB buffers).
            (600_001, ReduceOp::Avg),
        ] {
            let results = run(Box::new(move |rank, comm| {
                let data: Vec<f32> = (0..len).map(|i| uneven(rank, i)).collect();
                let mut whole = [Tensor::from_slice(&data)];
                let sent = |comm: &TcpCollective| comm.bytes_sent().unwrap_or(0);
                let before = sent(comm);
                comm.all_reduce(&mut whole, op, CTX).unwrap();
                let (reducing, before) = (sent(comm) - before, sent(comm));
                let mut flat = Tensor::from_slice(&data);
                let shard = comm.reduce_scatter(&mut flat, op, CTX).unwrap();
                let scattering = sent(comm) - before;
                let scattered = Vec::<f32>::try_from(&flat).unwrap();
                // What lies outside the shard is unspecified (a whole all-reduce leaves the
                // sums there): overwrite it, so that only the gathering can restore it.
                let (lo, hi) = (shard.start as i64, shard.end as i64);
                let _ = flat.narrow(0, 0, lo).fill_(f64::NAN);
                let _ = flat.narrow(0, hi, len as i64 - hi).fill_(f64::NAN);
                comm.all_gather_shards(&mut flat, CTX).unwrap();
                let reduced = Vec::<f32>::try_from(&whole[0]).unwrap();
                let gathered = Vec::<f32>::try_from(&flat).unwrap();
                let traffic = (reducing, scattering);
                (
                    bits(&reduced),
                    bits(&gathered),
                    shard,
                    bits(&scattered),
                    traffic,
                )
            }));
            let mut shards: Vec<_> = results.iter().map(|r| r.2.clone()).collect();
            shards.sort_by_key(|s| (s.start, s.end));
            assert_eq!(shards.first().map(|s| s.start), Some(0), "{name}");
            assert_eq!(shards.last().map(|s| s.end), Some(len), "{name}");
            assert!(
                shards.windows(2).all(|p| p[0].end == p[1].start),
                "{name}: {shards:?}"
            );
            let native = results.len() > 1 && !name.contains("hosts");
            let (reducing, scattering) =
                (results.iter()).fold((0, 0), |(r, s), x| (r + x.4 .0, s + x.4 .1));
            assert!(
                !native || scattering < reducing,
                "{name} len {len}: reduce_scatter sent {scattering} bytes, all_reduce {reducing}"
            );
            for (rank, (reduced, gathered, shard, scattered, _)) in results.iter().enumerate() {
                assert_eq!(&reduced, &&results[0].0, "{name}: ranks' all_reduce differ");
                assert_eq!(
                    scattered[shard.clone()],
                    reduced[shard.clone()],
                    "{name} rank {rank}: shard"
                );
                assert_eq!(gathered, reduced, "{name} rank {rank} len {len}: gathered");
            }
        }
    }
}
