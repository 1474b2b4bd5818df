//! The paged allocator never loses a page: every path ends with the
//! counters back at their start values.

use ascend_pd::memory::{
    ChunkLayout, ChunkMeta, DeviceKind, Dtype, MemFormat, MemObj, MemoryError, PagePool, PoolStats,
    RegisteredBuffer, SealedMemObj,
};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

fn layout() -> ChunkLayout {
    ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 2,
        tokens: 16,
        hidden: 32,
        dtype: Dtype::BFloat16,
    }
}

fn pool(pages: usize) -> Arc<PagePool> {
    let page = layout().page_bytes();
    PagePool::new(RegisteredBuffer::host(pages * page, page, false).unwrap())
}

fn full() -> ChunkMeta {
    ChunkMeta::full(layout())
}

fn assert_idle(p: &PagePool, total: usize) {
    let s = p.stats();
    assert_eq!(
        (s.total, s.free, s.allocated, s.pinned, s.quarantined),
        (total, total, 0, 0, 0),
        "{s:?}"
    );
}

#[test]
fn drop_returns_the_page_and_sealed_clones_share_it() {
    let p = pool(4);
    let a = p.allocate(full()).unwrap().seal();
    let b = a.clone();
    assert_eq!(a.ref_count(), 2);
    assert_eq!(a.buffer_ref(), b.buffer_ref());
    assert_eq!(p.stats().allocated, 1);
    drop(a);
    assert_eq!(p.stats().allocated, 1, "a clone still holds the page");
    drop(b);
    assert_idle(&p, 4);
    assert_eq!(p.stats().high_water, 1);
}

#[test]
fn pages_are_distinct_and_addressed_by_uuid_and_index() {
    let p = pool(3);
    let objs = p.allocate_batch(&[full(), full(), full()]).unwrap();
    let mut pages: Vec<u32> = objs.iter().map(|o| o.page()).collect();
    pages.sort();
    assert_eq!(pages, vec![0, 1, 2]);
    for o in &objs {
        assert_eq!(o.buffer_ref().uuid, p.uuid());
        assert_eq!(o.addr(), p.buffer().page_addr(o.page()).unwrap());
        assert_eq!(o.device(), DeviceKind::Cpu);
    }
}

#[test]
fn exhaustion_then_release_allows_allocation_again() {
    let p = pool(2);
    let held = p.allocate_batch(&[full(), full()]).unwrap();
    let e = p.allocate(full()).unwrap_err();
    assert!(
        matches!(
            e,
            MemoryError::Exhausted {
                free: 0,
                total: 2,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("1 page(s) requested, 0 of 2 free"),
        "{e}"
    );
    assert_eq!(p.stats().failed_allocations, 1);
    drop(held);
    let again = p.allocate(full()).unwrap();
    drop(again);
    assert_idle(&p, 2);
}

#[test]
fn failed_batch_allocates_nothing() {
    let p = pool(4);
    let one = p.allocate(full()).unwrap();
    let before = p.stats();
    let e = p.allocate_batch(&[full(); 4]).unwrap_err();
    assert!(
        matches!(
            e,
            MemoryError::Exhausted {
                requested: 4,
                free: 3,
                ..
            }
        ),
        "{e}"
    );
    let after = p.stats();
    assert_eq!(
        (after.free, after.allocated),
        (before.free, before.allocated)
    );
    drop(one);
    assert_idle(&p, 4);
}

#[test]
fn oversized_or_empty_chunk_is_rejected_without_allocating() {
    let p = pool(2);
    let bigger = ChunkMeta::partial(layout(), 17);
    let e = p.allocate(bigger).unwrap_err();
    assert!(
        matches!(e, MemoryError::ChunkDoesNotFit { tokens: 17, .. }),
        "{e}"
    );
    assert!(p.allocate(ChunkMeta::partial(layout(), 0)).is_err());
    let mut wide = layout();
    wide.hidden = 64;
    assert!(p.allocate(ChunkMeta::full(wide)).is_err());
    assert_idle(&p, 2);
}

#[test]
fn partial_chunk_is_a_prefix_of_its_page() {
    let p = pool(1);
    let mut o = p.allocate(ChunkMeta::partial(layout(), 5)).unwrap();
    assert_eq!(o.shape(), [2, 2, 5, 32]);
    assert_eq!(o.byte_len(), 2 * 2 * 5 * 32 * 2);
    assert!(o.byte_len() < p.buffer().page_size());
    o.host_bytes_mut().unwrap().fill(7);
    assert_eq!(o.host_bytes().unwrap().len(), o.byte_len());
    assert!(o.host_bytes().unwrap().iter().all(|&b| b == 7));
    // Writing again needs the only handle: a sealed page is writable only
    // once every other holder let go.
    let sealed = o.seal();
    let c = sealed.clone();
    let sealed = sealed.try_unseal().expect_err("a clone still reads it");
    drop(c);
    let mut o = sealed.try_unseal().expect("the last holder");
    assert!(o.host_bytes_mut().is_some());
}

#[test]
fn pins_are_counted_per_page_and_cleared_on_drop() {
    let p = pool(3);
    let a = p.allocate(full()).unwrap().seal();
    let b = p.allocate(full()).unwrap().seal();
    a.pin();
    a.pin();
    b.pin();
    assert_eq!(p.stats().pinned, 2);
    assert!(a.unpin());
    assert_eq!(p.stats().pinned, 2, "a still has one pin");
    assert!(a.unpin());
    assert!(!a.unpin(), "unpin of an unpinned page reports false");
    assert_eq!(p.stats().pinned, 1);
    // Dropping a pinned page clears its pin accounting.
    drop(b);
    assert_eq!(p.stats().pinned, 0);
    assert_eq!(p.stats().pinned_high_water, 2);
    drop(a);
    assert_idle(&p, 3);
}

#[test]
fn clone_drop_storm_across_threads_leaks_nothing() {
    let p = pool(16);
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let p = Arc::clone(&p);
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                barrier.wait();
                let mut held: Vec<SealedMemObj> = Vec::new();
                for i in 0..2_000usize {
                    match (i + t) % 5 {
                        0 | 1 => {
                            if let Ok(o) = p.allocate(full()).map(MemObj::seal) {
                                if i % 3 == 0 {
                                    o.pin();
                                }
                                held.push(o);
                            }
                        }
                        2 => {
                            if let Some(o) = held.last() {
                                let c = o.clone();
                                c.pin();
                                held.push(c);
                            }
                        }
                        3 => {
                            if let Some(o) = held.pop() {
                                o.unpin();
                            }
                        }
                        _ => {
                            if let Ok(batch) = p.allocate_batch(&[full(), full()]) {
                                held.extend(batch.into_iter().map(MemObj::seal));
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_idle(&p, 16);
    assert!(p.stats().high_water <= 16);
}

#[test]
fn allocation_waits_until_pages_come_back() {
    let p = pool(2);
    let held = p.allocate_batch(&[full(), full()]).unwrap();
    let releaser = thread::spawn(move || {
        thread::sleep(Duration::from_millis(50));
        drop(held);
    });
    let got = p
        .allocate_batch_until(&[full(), full()], Instant::now() + Duration::from_secs(10))
        .unwrap();
    releaser.join().unwrap();
    assert_eq!(got.len(), 2);
    drop(got);
    assert_idle(&p, 2);
}

#[test]
fn allocation_until_deadline_times_out_and_allocates_nothing() {
    let p = pool(2);
    let held = p.allocate(full()).unwrap();
    let e = p
        .allocate_batch_until(
            &[full(), full()],
            Instant::now() + Duration::from_millis(30),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            MemoryError::Timeout {
                requested: 2,
                free: 1,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("timed out"), "{e}");
    assert_eq!(p.stats().allocated, 1);
    drop(held);
    // More pages than the pool has can never succeed: fail at once.
    let start = Instant::now();
    let e = p
        .allocate_batch_until(&[full(); 3], Instant::now() + Duration::from_secs(30))
        .unwrap_err();
    assert!(matches!(e, MemoryError::Exhausted { .. }), "{e}");
    assert!(start.elapsed() < Duration::from_secs(30));
    assert_idle(&p, 2);
}

#[test]
fn panic_unwinding_returns_pages() {
    let p = pool(4);
    let p2 = Arc::clone(&p);
    let r = thread::spawn(move || {
        let objs: Vec<SealedMemObj> = p2
            .allocate_batch(&[full(), full(), full()])
            .unwrap()
            .into_iter()
            .map(MemObj::seal)
            .collect();
        objs[0].pin();
        panic!("worker died holding {} pages", objs.len());
    })
    .join();
    assert!(r.is_err());
    assert_idle(&p, 4);
}

#[test]
fn stats_are_consistent() {
    let p = pool(5);
    let objs = p.allocate_batch(&[full(); 3]).unwrap();
    let s: PoolStats = p.stats();
    assert_eq!(s.free + s.allocated, s.total);
    assert_eq!(s.high_water, 3);
    drop(objs);
}
