//! Fake addresses: the DNS server answers an allowed name with an address of its own from
//! 198.18.0.0/15 (RFC 2544's benchmarking range, never used on the internet) and remembers which
//! name it stands for, so a connection to that address can be sent to the host by name.
//!
//! - Stable: a name keeps its address as long as it is in the table.
//! - Bounded: at most `capacity` names ([`DEFAULT_CAPACITY`] in the agent); a new name beyond that takes the place of
//!   the least recently used one (looked up or connected to).
//! - Addresses are handed out round-robin over the whole range (131 069 usable), skipping those
//!   in use, so an address given up by an evicted name is reused as late as possible: a program
//!   that kept a stale address for a while does not reach another name by accident.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::sync::Mutex;

/// 198.18.0.0/15.
pub const FAKE_NET: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 0);
pub const FAKE_PREFIX: u8 = 15;
/// The address `lo` carries in the fake range (never handed out).
pub const FAKE_LO: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// Names remembered at once by default (a few MiB at most, names being ≤ 253 bytes).
pub const DEFAULT_CAPACITY: usize = 16_384;

const RANGE: u32 = 1 << (32 - FAKE_PREFIX);
/// Offsets 0 (the network), 1 (lo's) and the last are never handed out.
const FIRST: u32 = 2;
const LAST: u32 = RANGE - 2;

pub fn is_fake(ip: Ipv4Addr) -> bool {
    u32::from(ip) >> (32 - FAKE_PREFIX) == u32::from(FAKE_NET) >> (32 - FAKE_PREFIX)
}

struct Entry {
    name: String,
    stamp: u64,
}

struct Table {
    by_name: HashMap<String, u32>,
    /// Offset in the range → entry.
    by_offset: HashMap<u32, Entry>,
    /// Last use → offset: the first entry is the least recently used.
    lru: BTreeMap<u64, u32>,
    clock: u64,
    /// Next offset to try.
    cursor: u32,
}

pub struct FakeIps {
    table: Mutex<Table>,
    capacity: usize,
}

impl FakeIps {
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, (LAST - FIRST + 1) as usize);
        Self {
            table: Mutex::new(Table {
                by_name: HashMap::new(),
                by_offset: HashMap::new(),
                lru: BTreeMap::new(),
                clock: 0,
                cursor: FIRST,
            }),
            capacity,
        }
    }

    /// The address standing for `name` (normalised by the caller: lowercase, no final dot),
    /// allocating one if needed.
    pub fn address_for(&self, name: &str) -> Ipv4Addr {
        let mut t = self.table.lock().unwrap();
        if let Some(&offset) = t.by_name.get(name) {
            t.touch(offset);
            return to_ip(offset);
        }
        if t.by_offset.len() >= self.capacity {
            let (_, oldest) = t.lru.pop_first().expect("a full table has a least recently used entry");
            let entry = t.by_offset.remove(&oldest).expect("lru and table agree");
            t.by_name.remove(&entry.name);
        }
        // A free offset exists: fewer entries than usable offsets.
        let mut offset = t.cursor;
        while t.by_offset.contains_key(&offset) {
            offset = next(offset);
        }
        t.cursor = next(offset);
        t.clock += 1;
        let stamp = t.clock;
        t.by_offset.insert(offset, Entry { name: name.to_string(), stamp });
        t.by_name.insert(name.to_string(), offset);
        t.lru.insert(stamp, offset);
        to_ip(offset)
    }

    /// The name a fake address stands for (and marks it used), or None if it stands for none.
    pub fn name_for(&self, ip: Ipv4Addr) -> Option<String> {
        if !is_fake(ip) {
            return None;
        }
        let offset = u32::from(ip) - u32::from(FAKE_NET);
        let mut t = self.table.lock().unwrap();
        let name = t.by_offset.get(&offset)?.name.clone();
        t.touch(offset);
        Some(name)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().unwrap().by_offset.len()
    }
}

impl Table {
    fn touch(&mut self, offset: u32) {
        self.clock += 1;
        let stamp = self.clock;
        let entry = self.by_offset.get_mut(&offset).expect("touched entry exists");
        let old = std::mem::replace(&mut entry.stamp, stamp);
        self.lru.remove(&old);
        self.lru.insert(stamp, offset);
    }
}

fn next(offset: u32) -> u32 {
    if offset >= LAST {
        FIRST
    } else {
        offset + 1
    }
}

fn to_ip(offset: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(FAKE_NET) + offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stable_reversible_and_in_range() {
        let t = FakeIps::new(100);
        let a = t.address_for("example.com");
        let b = t.address_for("example.org");
        assert_ne!(a, b);
        assert_eq!(t.address_for("example.com"), a, "stable per name");
        assert!(is_fake(a) && is_fake(b));
        assert_eq!(a, Ipv4Addr::new(198, 18, 0, 2), "never the network or lo's own address");
        assert_eq!(t.name_for(a).as_deref(), Some("example.com"));
        assert_eq!(t.name_for(Ipv4Addr::new(198, 19, 255, 254)), None, "not handed out");
        assert_eq!(t.name_for(Ipv4Addr::new(10, 0, 0, 1)), None);
        assert!(is_fake(Ipv4Addr::new(198, 19, 255, 255)));
        assert!(!is_fake(Ipv4Addr::new(198, 20, 0, 0)));
        assert!(!is_fake(Ipv4Addr::new(198, 17, 255, 255)));
    }

    #[test]
    fn bounded_with_lru_eviction_and_late_reuse() {
        let t = FakeIps::new(3);
        let a = t.address_for("a");
        let b = t.address_for("b");
        let c = t.address_for("c");
        // "a" is used again: "b" is now the least recently used.
        assert_eq!(t.name_for(a).as_deref(), Some("a"));
        let d = t.address_for("d");
        assert_eq!(t.len(), 3);
        assert_eq!(t.name_for(b), None, "b was evicted");
        assert_eq!(t.name_for(a).as_deref(), Some("a"));
        assert_eq!(t.name_for(c).as_deref(), Some("c"));
        // b's address is not handed out again at once: the cursor moves on.
        assert_ne!(d, b);
        assert_eq!(u32::from(d), u32::from(c) + 1);
        // A name that comes back gets a new address.
        let b2 = t.address_for("b");
        assert_ne!(b2, b);
    }

    #[test]
    fn wraps_around_the_range_skipping_used_offsets() {
        let t = FakeIps::new(2);
        let keep = t.address_for("keep");
        for i in 0..(LAST - FIRST + 5) {
            // Touch "keep" so it is never the one evicted.
            assert_eq!(t.name_for(keep).as_deref(), Some("keep"));
            let ip = t.address_for(&format!("n{i}"));
            assert_ne!(ip, keep);
            assert!(is_fake(ip) && ip != FAKE_LO && ip != FAKE_NET);
        }
    }
}
