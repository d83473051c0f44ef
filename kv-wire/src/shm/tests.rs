//! The shared-memory protocol's unit tests: slots written by one side and read by the other,
//! regions read in place, orphans removed, the pool's blocks sent where they are.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::files::MAKING;
use super::*;

#[test]
fn slots_written_by_one_side_are_read_by_the_other_and_recycled() {
    let dir = tempdir();
    let staging = Staging::create(&dir, 4096, 4).unwrap();
    let regions = Regions::new(dir.clone());
    let mut slots = staging.alloc(3).unwrap();
    assert_eq!(slots.offsets(), vec![0, 4096, 8192], "lowest slots first");
    assert!(staging.alloc(2).is_none(), "one slot left");
    slots.block_mut(1).fill(7);
    let region = regions.get(staging.name()).unwrap();
    assert_eq!(&region.bytes(4096, 4096).unwrap()[..], &[7u8; 4096][..]);
    region.write(8192, &[9u8; 4096]).unwrap();
    assert_eq!(slots.block(2), &[9u8; 4096][..]);
    assert!(matches!(region.write(4 * 4096 - 1, &[0u8; 2]), Err(RegionError::OutOfRange { .. })));
    drop(slots);
    assert_eq!(staging.free_slots(), 4);
    assert_eq!(staging.alloc(4).unwrap().offsets().len(), 4);
    // Only regions' names are mapped.
    for bad in ["../etc/passwd", "ferry-kv-", "other", "ferry-kv-a/b"] {
        assert!(matches!(regions.get(bad), Err(RegionError::Name(_))), "{bad}");
    }
    let path = dir.join(staging.name());
    drop(staging);
    assert!(!path.exists(), "the region's file goes with it");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_peer_region_is_read_in_place_and_never_written() {
    let dir = tempdir();
    let (agent, executor) =
        (Staging::create(&dir, 4096, 4).unwrap(), Staging::create(&dir, 4096, 2).unwrap());
    let mut stored = agent.alloc(2).unwrap();
    stored.block_mut(1).fill(5);
    let offset = agent.locate(stored.block(1)).expect("a whole slot of the region");
    assert_eq!(offset, 4096);
    assert_eq!(agent.locate(&stored.block(1)[1..]), None, "not a whole slot");
    assert_eq!(executor.locate(stored.block(1)), None, "not a slot of this region");
    let region = executor.peers().get(agent.name()).unwrap();
    assert!(matches!(region.write(0, &[1u8; 16]), Err(RegionError::ReadOnly(_))));
    let place = Place::Store { region: region.clone(), offset };
    let mine = executor.alloc(1).unwrap();
    assert_eq!(place.bytes(&mine, 0).unwrap(), &[5u8; 4096][..]);
    let past = Place::Store { region, offset: 4 * 4096 };
    assert!(matches!(past.bytes(&mine, 0), Err(RegionError::OutOfRange { .. })));
    drop((stored, mine, executor, agent));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_dead_process_region_is_removed_when_the_next_is_made() {
    let dir = tempdir();
    let live = Staging::create(&dir, 64, 1).unwrap();
    // Left behind by a process that ended (nobody holds its lock), one of them while it
    // was being made; whatever pid their names carry (this one's, here).
    let pid = std::process::id();
    let orphans = [format!("{PREFIX}{pid}-77-0"), format!("{MAKING}{PREFIX}{pid}-78-0")];
    for orphan in &orphans {
        std::fs::write(dir.join(orphan), b"left behind").unwrap();
    }
    let other = dir.join("not-a-region");
    std::fs::write(&other, b"someone else's").unwrap();
    let mine = Staging::create(&dir, 64, 1).unwrap();
    for orphan in &orphans {
        assert!(!dir.join(orphan).exists(), "{orphan} was removed");
    }
    assert!(dir.join(live.name()).exists(), "a live region stays, its pid notwithstanding");
    assert!(dir.join(mine.name()).exists() && other.exists());
    assert_ne!(live.name(), mine.name());
    drop((live, mine));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_pool_region_shares_the_pool_and_sends_its_blocks_where_they_are() {
    let dir = tempdir();
    let (region, mut pool) = Staging::create_with_pool(&dir, 4096, 3, 2).unwrap();
    assert_eq!(pool.bytes().len(), 3 * 4096);
    assert_eq!(pool.floats().len(), 3 * 1024);
    pool.bytes_mut()[4096..8192].fill(6);
    // Staging slots come after the pool, and only they are allocated and given back.
    let staged = region.alloc(2).unwrap();
    assert_eq!(staged.offsets(), vec![3 * 4096, 4 * 4096]);
    assert!(region.alloc(1).is_none());
    // Pool blocks named as slots: the agent reads the pool's bytes at their offsets.
    let sent = region.pool_slots(&[1, 0]).unwrap();
    assert_eq!(sent.offsets(), vec![4096, 0]);
    let agent = Regions::new(dir.clone());
    let mapped = agent.get(region.name()).unwrap();
    assert_eq!(&mapped.bytes(4096, 4096).unwrap()[..], &[6u8; 4096][..]);
    // Checksums published in place are those of the pool's bytes.
    let (mut filler, sent_slots, filled) = filling(sent);
    filler.publish_in_place();
    let want: Vec<u32> = crate::frames::chunk_crcs(&[6u8; 4096]).collect();
    assert_eq!(filled.borrow()[0], want);
    drop((filler, sent_slots));
    assert_eq!(region.free_slots(), 0, "pool blocks are not staging slots");
    drop(staged);
    assert_eq!(region.free_slots(), 2);
    assert!(region.pool_slots(&[3]).is_none(), "block 3 is a staging slot, not the pool's");
    assert!(region.pool_slots(&[]).is_none());
    drop((pool, mapped, region));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_mapping_of_a_removed_region_is_dropped_when_a_new_region_is_mapped() {
    let dir = tempdir();
    let agent = Regions::new(dir.clone());
    let (old, new) =
        (Staging::create(&dir, 4096, 1).unwrap(), Staging::create(&dir, 4096, 1).unwrap());
    let mapped = agent.get(old.name()).unwrap();
    let weak = Arc::downgrade(&mapped);
    drop((mapped, old)); // its maker ended: the file is gone
    assert!(weak.upgrade().is_some(), "still mapped by the agent");
    agent.get(new.name()).unwrap();
    assert!(weak.upgrade().is_none(), "the dead region's mapping went with its file");
    drop(new);
    let _ = std::fs::remove_dir_all(dir);
}

fn tempdir() -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "ferry-shm-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
