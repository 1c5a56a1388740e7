//! Writes a [`Tree`] as an uncompressed erofs image, the read-only root filesystem of a guest
//! (Linux 6.1 and later, `rootfstype=erofs`). Struct, constant and function names in comments
//! are the kernel's (`fs/erofs/`).
//!
//! Layout, in 4 KiB blocks:
//! - block 0 holds `erofs_super_block` at byte 1024, and the metadata area (`meta_blkaddr` 0)
//!   starts right after it, so the root directory's inode, placed first, gets nid 36 (a
//!   `root_nid` has 16 bits);
//! - the metadata area: every inode as a 64-byte `erofs_inode_extended` in 32-byte slots
//!   (nid = offset / 32), each followed by its inline xattrs and, when its layout is
//!   `EROFS_INODE_FLAT_INLINE`, by the tail of its data (what follows its last whole block);
//!   an inode, its xattrs and its tail never cross a block;
//! - then the data area: the whole blocks of each file, directory and long symlink,
//!   contiguous from its `raw_blkaddr` (`EROFS_INODE_FLAT_PLAIN` when the tail, if any, does
//!   not fit beside the inode).
//!
//! Inodes are numbered breadth-first from the root, each directory's children in name order, so
//! the same tree always gives the same bytes.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use crate::tree::{Kind, NodeId, Tree, ROOT};

/// What the superblock says about the image.
pub struct Options {
    pub uuid: [u8; 16],
    /// At most 15 bytes are kept, cut at a character boundary: the kernel rejects a
    /// `volume_name` that fills its 16 bytes without a NUL.
    pub volume_name: String,
    /// Seconds since the epoch (`build_time`; erofs gives it only to compact inodes, which are
    /// not written, so it is informative).
    pub build_time: i64,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Inodes written: the nodes reachable from the root, hard links counted once.
    pub inodes: u64,
    /// Image size in 4 KiB blocks.
    pub blocks: u64,
    /// Image size in bytes.
    pub bytes: u64,
    /// Xattrs left out: those whose names have a prefix other than `user.`, `trusted.` and
    /// `security.`, or nothing after it (counted per inode).
    pub skipped_xattrs: u64,
}

/// File types in `i_mode`, as Linux stores them on disk (whatever host writes the image: on
/// macOS libc's constants are another width).
const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;
const S_IFBLK: u32 = 0o060000;
const S_IFIFO: u32 = 0o010000;
const S_IFSOCK: u32 = 0o140000;

const BLOCK: usize = 4096;
const BLK: u64 = BLOCK as u64;
const BLK_BITS: u8 = 12;
/// `EROFS_SUPER_OFFSET`.
const SUPER_OFFSET: usize = 1024;
/// `sizeof(struct erofs_super_block)`.
const SUPER_SIZE: usize = 128;
/// `EROFS_SUPER_MAGIC_V1`.
const SUPER_MAGIC: u32 = 0xE0F5_E1E2;
/// `EROFS_FEATURE_COMPAT_MTIME`: inode timestamps are mtimes (set by mkfs.erofs too; readers
/// that do not know it may ignore it).
const FEATURE_COMPAT_MTIME: u32 = 0x2;
/// The first inode slot, right after the superblock.
const META_START: u64 = (SUPER_OFFSET + SUPER_SIZE) as u64;
/// Inode slot size (`1 << islotbits`): nids count these from the metadata area's start.
const SLOT: u64 = 32;
/// `sizeof(struct erofs_inode_extended)`.
const INODE_SIZE: u64 = 64;
/// `sizeof(struct erofs_xattr_ibody_header)`.
const XATTR_HEADER: u64 = 12;
/// `sizeof(struct erofs_xattr_entry)`, also the alignment of each entry.
const XATTR_ENTRY: u64 = 4;
/// `sizeof(struct erofs_dirent)`.
const DIRENT: usize = 12;
/// `EROFS_NAME_LEN`: the longest file name, and the longest xattr name after its prefix.
const NAME_LEN: usize = 255;
/// `EROFS_NULL_ADDR`, the `raw_blkaddr` of inodes without data blocks (as mkfs.erofs writes).
const NULL_ADDR: u32 = u32::MAX;
/// `EROFS_INODE_LAYOUT_EXTENDED` in bit 0 of `i_format`; the data layout is in bits 1-3.
const LAYOUT_EXTENDED: u16 = 1;
const FLAT_PLAIN: u16 = 0;
const FLAT_INLINE: u16 = 2;
/// Xattr name prefixes erofs indexes (`EROFS_XATTR_INDEX_*`). The others (POSIX ACLs among
/// them) are skipped.
const XATTR_PREFIXES: [(&[u8], u8); 3] = [(b"user.", 1), (b"trusted.", 4), (b"security.", 6)];
/// Longest symlink target Linux handles (`PATH_MAX` less the NUL).
const SYMLINK_MAX: usize = 4095;
/// File contents are copied through a buffer of this size.
const CHUNK: usize = 1 << 20;

/// Writes the image of `tree` to `out` (from offset 0; `out` is truncated/extended to the image size).
pub fn write(tree: &Tree, out: &File, opts: &Options) -> io::Result<Stats> {
    let mut plan = Plan::walk(tree)?;
    plan.place()?;
    let bytes = plan.blocks * BLK;
    // Truncating first makes every byte not written below (all padding) zero.
    out.set_len(0)?;
    out.set_len(bytes)?;
    let mut meta = MetaWriter { out, blk: 0, buf: vec![0; BLOCK] };
    meta.buf[SUPER_OFFSET..SUPER_OFFSET + SUPER_SIZE].copy_from_slice(&plan.superblock(opts)?);
    let mut scratch = vec![0; CHUNK];
    for i in 0..plan.inodes.len() {
        let tail = plan.write_data(i, out, &mut scratch)?;
        meta.put(plan.inodes[i].nid * SLOT, &plan.encode_inode(i, &tail))?;
    }
    meta.flush()?;
    Ok(Stats { inodes: plan.inodes.len() as u64, blocks: plan.blocks, bytes, skipped_xattrs: plan.skipped_xattrs })
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("erofs: {msg}"))
}

/// An xattr kept: `erofs_xattr_entry` fields.
struct Xattr<'a> {
    index: u8,
    suffix: &'a [u8],
    value: &'a [u8],
}

/// A reachable node, numbered by its place in [`Plan::inodes`].
struct Inode<'a> {
    node: NodeId,
    /// The name it was first reached by (empty for the root), for messages.
    name: &'a [u8],
    /// The directory that name is in (the root's is itself): `..` for a directory.
    parent: usize,
    nlink: u32,
    xattrs: Vec<Xattr<'a>>,
    /// `erofs_xattr_ibody_size()`: 0, or the header and the entries.
    ibody: u64,
    /// `i_size`.
    size: u64,
    /// `EROFS_INODE_FLAT_INLINE`: the data's tail follows the inode.
    inline: bool,
    nid: u64,
    raw_blkaddr: u32,
}

struct Plan<'a> {
    tree: &'a Tree,
    inodes: Vec<Inode<'a>>,
    index: HashMap<NodeId, usize>,
    skipped_xattrs: u64,
    /// Image size in blocks.
    blocks: u64,
}

impl<'a> Plan<'a> {
    /// Numbers the nodes reachable from the root, counts their links and sizes their data.
    fn walk(tree: &'a Tree) -> io::Result<Self> {
        if tree.entries(ROOT).is_none() {
            return Err(invalid("the root is not a directory".into()));
        }
        let mut plan = Plan { tree, inodes: Vec::new(), index: HashMap::new(), skipped_xattrs: 0, blocks: 0 };
        plan.add(ROOT, b"", 0)?;
        let mut queue = VecDeque::from([0]);
        while let Some(dir) = queue.pop_front() {
            let entries = tree.entries(plan.inodes[dir].node).expect("only directories are queued");
            let mut subdirs = 0u32;
            for (name, &child) in entries {
                check_name(name).map_err(|why| invalid(format!("{}: {why}", plan.child_path(dir, name))))?;
                let is_dir = tree.entries(child).is_some();
                if let Some(&i) = plan.index.get(&child) {
                    if is_dir {
                        return Err(invalid(format!(
                            "{}: directory {} has a second name (or is its own ancestor)",
                            plan.child_path(dir, name),
                            plan.path(i)
                        )));
                    }
                    let nlink = plan.inodes[i].nlink.checked_add(1);
                    plan.inodes[i].nlink =
                        nlink.ok_or_else(|| invalid(format!("{}: too many hard links", plan.path(i))))?;
                } else {
                    let i = plan.add(child, name, dir)?;
                    if is_dir {
                        queue.push_back(i);
                        subdirs += 1;
                    }
                }
            }
            // A directory's links: its name, its `.` and its subdirectories' `..`.
            plan.inodes[dir].nlink = subdirs
                .checked_add(2)
                .ok_or_else(|| invalid(format!("{}: too many subdirectories", plan.path(dir))))?;
        }
        // A directory's size depends only on its names, all known now. Whole blocks, then what
        // the last one uses: `erofs_readdir` reads min(i_size - pos, block size) of each.
        for i in 0..plan.inodes.len() {
            if tree.entries(plan.inodes[i].node).is_some() {
                let blocks = dir_blocks(&plan.dirents(i));
                let last = blocks.last().expect("a directory has `.` and `..`").1;
                plan.inodes[i].size = (blocks.len() as u64 - 1) * BLK + last as u64;
            }
        }
        Ok(plan)
    }

    /// Numbers `node`, reached as `name` in inode `parent`, and checks what it holds.
    fn add(&mut self, node: NodeId, name: &'a [u8], parent: usize) -> io::Result<usize> {
        let i = self.inodes.len();
        // `i_ino` is i + 1 (32 bits; the kernel's inode numbers are nids, but 32-bit stat uses it).
        if i >= u32::MAX as usize {
            return Err(invalid("more than 4294967294 inodes".into()));
        }
        self.inodes.push(Inode {
            node,
            name,
            parent,
            nlink: 1,
            xattrs: Vec::new(),
            ibody: 0,
            size: 0,
            inline: false,
            nid: 0,
            raw_blkaddr: NULL_ADDR,
        });
        self.index.insert(node, i);
        let meta = &self.tree.node(node).meta;
        let mut xattrs = Vec::new();
        let mut ibody = XATTR_HEADER;
        for (full, value) in &meta.xattrs {
            let Some((index, suffix)) = xattr_index(full) else {
                self.skipped_xattrs += 1;
                continue;
            };
            if suffix.len() > NAME_LEN {
                return Err(invalid(format!(
                    "{}: xattr name {} is longer than {NAME_LEN} bytes after its prefix",
                    self.path(i),
                    String::from_utf8_lossy(full)
                )));
            }
            ibody += (XATTR_ENTRY + suffix.len() as u64 + value.len() as u64).next_multiple_of(XATTR_ENTRY);
            xattrs.push(Xattr { index, suffix, value });
        }
        if !xattrs.is_empty() {
            // The kernel could follow xattrs into the next block, but keeping an inode and its
            // xattrs in one block keeps the inline tail's placement simple.
            if INODE_SIZE + ibody > BLK {
                return Err(invalid(format!(
                    "{}: its xattrs take {ibody} bytes; at most {} fit inline in an inode's block",
                    self.path(i),
                    BLK - INODE_SIZE
                )));
            }
            self.inodes[i].ibody = ibody;
            self.inodes[i].xattrs = xattrs;
        }
        self.inodes[i].size = match &self.tree.node(node).kind {
            Kind::File(extent) => extent.len,
            Kind::Symlink(target) => {
                if target.is_empty() || target.len() > SYMLINK_MAX || target.contains(&0) {
                    return Err(invalid(format!(
                        "{}: a symlink target must have 1 to {SYMLINK_MAX} bytes and no NUL (it has {})",
                        self.path(i),
                        target.len()
                    )));
                }
                target.len() as u64
            }
            Kind::Char { major, minor } | Kind::Block { major, minor } => {
                encode_dev(*major, *minor).ok_or_else(|| {
                    invalid(format!(
                        "{}: device {major}:{minor} does not fit Linux's 12-bit major, 20-bit minor",
                        self.path(i)
                    ))
                })?;
                0
            }
            Kind::Dir(_) | Kind::Fifo | Kind::Socket => 0,
        };
        Ok(i)
    }

    /// Directory `i`'s entries as `(name, inode)`, `.` and `..` included, sorted by name bytes
    /// (the kernel's `erofs_namei` binary-searches blocks by their first name, then each block).
    fn dirents(&self, i: usize) -> Vec<(&'a [u8], usize)> {
        let entries = self.tree.entries(self.inodes[i].node).expect("a directory");
        let mut ents = Vec::with_capacity(entries.len() + 2);
        ents.push((&b"."[..], i));
        ents.push((&b".."[..], self.inodes[i].parent));
        ents.extend(entries.iter().map(|(name, child)| (name.as_slice(), self.index[child])));
        ents.sort_unstable_by(|a, b| a.0.cmp(b.0));
        ents
    }

    /// Gives every inode its nid and data layout, then its data blocks.
    fn place(&mut self) -> io::Result<()> {
        let mut cursor = META_START;
        for inode in &mut self.inodes {
            let meta = INODE_SIZE + inode.ibody;
            let kind = &self.tree.node(inode.node).kind;
            let has_data = matches!(kind, Kind::File(_) | Kind::Dir(_) | Kind::Symlink(_));
            // `erofs_map_blocks_flatmode`: with FLAT_INLINE the last (partial) block's bytes
            // follow the inode and its xattrs, in the same block.
            let tail = if has_data { inode.size % BLK } else { 0 };
            let can_inline = tail > 0 && meta + tail <= BLK;
            let at = cursor % BLK;
            let (start, inline) = if can_inline && at + meta + tail <= BLK {
                (cursor, true)
            } else if at + meta > BLK || (can_inline && at >= tail) {
                // The inode does not fit here, or padding to the next block (BLK - at bytes)
                // wastes no more than a data block for the tail would (BLK - tail).
                (cursor.next_multiple_of(BLK), can_inline)
            } else {
                (cursor, false)
            };
            inode.nid = start / SLOT;
            inode.inline = inline;
            cursor = (start + meta + if inline { tail } else { 0 }).next_multiple_of(SLOT);
        }
        let mut next = cursor.div_ceil(BLK);
        for inode in &mut self.inodes {
            let blocks = if inode.inline { inode.size / BLK } else { inode.size.div_ceil(BLK) };
            if blocks > 0 {
                inode.raw_blkaddr = u32::try_from(next).map_err(|_| too_big(next))?;
                next += blocks;
            }
        }
        if next > u64::from(u32::MAX) {
            return Err(too_big(next));
        }
        self.blocks = next;
        Ok(())
    }

    /// `struct erofs_super_block`.
    fn superblock(&self, opts: &Options) -> io::Result<[u8; SUPER_SIZE]> {
        let root_nid = u16::try_from(self.inodes[0].nid).expect("the root is the first inode");
        let mut sb = [0u8; SUPER_SIZE];
        sb[0..4].copy_from_slice(&SUPER_MAGIC.to_le_bytes());
        // checksum (4..8) stays 0: EROFS_FEATURE_COMPAT_SB_CHKSUM is not set.
        sb[8..12].copy_from_slice(&FEATURE_COMPAT_MTIME.to_le_bytes());
        sb[12] = BLK_BITS;
        // sb_extslots (13) 0: the superblock is 128 bytes.
        sb[14..16].copy_from_slice(&root_nid.to_le_bytes());
        sb[16..24].copy_from_slice(&(self.inodes.len() as u64).to_le_bytes());
        sb[24..32].copy_from_slice(&opts.build_time.to_le_bytes());
        // build_time_nsec (32..36) 0.
        let blocks = u32::try_from(self.blocks).map_err(|_| too_big(self.blocks))?;
        sb[36..40].copy_from_slice(&blocks.to_le_bytes());
        // meta_blkaddr (40..44) and xattr_blkaddr (44..48) 0: metadata starts in block 0, no
        // shared xattrs.
        sb[48..64].copy_from_slice(&opts.uuid);
        let mut cut = opts.volume_name.len().min(15);
        while !opts.volume_name.is_char_boundary(cut) {
            cut -= 1;
        }
        sb[64..64 + cut].copy_from_slice(&opts.volume_name.as_bytes()[..cut]);
        // feature_incompat, compression, devices, dirblkbits (must be 0), packed_nid: all 0.
        Ok(sb)
    }

    /// Writes inode `i`'s whole data blocks and returns its inline tail (empty without one).
    fn write_data(&self, i: usize, out: &File, scratch: &mut [u8]) -> io::Result<Vec<u8>> {
        let inode = &self.inodes[i];
        let at = u64::from(inode.raw_blkaddr) * BLK;
        let tail_len = if inode.inline { inode.size % BLK } else { 0 };
        match &self.tree.node(inode.node).kind {
            Kind::File(extent) => {
                let body = inode.size - tail_len;
                let mut off = 0;
                while off < body {
                    let n = (body - off).min(scratch.len() as u64) as usize;
                    self.tree.read_content(*extent, off, &mut scratch[..n])?;
                    out.write_all_at(&scratch[..n], at + off)?;
                    off += n as u64;
                }
                let mut tail = vec![0; tail_len as usize];
                self.tree.read_content(*extent, body, &mut tail)?;
                Ok(tail)
            }
            Kind::Symlink(target) if inode.inline => Ok(target.clone()),
            Kind::Symlink(target) => {
                out.write_all_at(target, at)?;
                Ok(Vec::new())
            }
            Kind::Dir(_) => self.write_dir(i, out),
            Kind::Char { .. } | Kind::Block { .. } | Kind::Fifo | Kind::Socket => Ok(Vec::new()),
        }
    }

    /// Writes directory `i`'s blocks: each an array of `erofs_dirent` then their names, with no
    /// NUL; zeros after the last name end it (`erofs_fill_dentries`, `erofs_dirnamecmp`).
    fn write_dir(&self, i: usize, out: &File) -> io::Result<Vec<u8>> {
        let inode = &self.inodes[i];
        let ents = self.dirents(i);
        let blocks = dir_blocks(&ents);
        let mut block = vec![0u8; BLOCK];
        for (b, (range, used)) in blocks.iter().enumerate() {
            block.fill(0);
            let mut nameoff = range.len() * DIRENT;
            for (k, &(name, target)) in ents[range.clone()].iter().enumerate() {
                let t = &self.inodes[target];
                let dirent = &mut block[k * DIRENT..(k + 1) * DIRENT];
                dirent[0..8].copy_from_slice(&t.nid.to_le_bytes());
                dirent[8..10].copy_from_slice(&(nameoff as u16).to_le_bytes());
                dirent[10] = file_type(&self.tree.node(t.node).kind);
                block[nameoff..nameoff + name.len()].copy_from_slice(name);
                nameoff += name.len();
            }
            debug_assert_eq!(nameoff, *used);
            if b + 1 == blocks.len() && inode.inline {
                return Ok(block[..*used].to_vec());
            }
            out.write_all_at(&block[..*used], (u64::from(inode.raw_blkaddr) + b as u64) * BLK)?;
        }
        Ok(Vec::new())
    }

    /// `struct erofs_inode_extended`, then the inline xattrs, then the inline data `tail`.
    fn encode_inode(&self, i: usize, tail: &[u8]) -> Vec<u8> {
        let inode = &self.inodes[i];
        let node = self.tree.node(inode.node);
        let (file_fmt, i_u) = match &node.kind {
            Kind::Dir(_) => (S_IFDIR, inode.raw_blkaddr),
            Kind::File(_) => (S_IFREG, inode.raw_blkaddr),
            Kind::Symlink(_) => (S_IFLNK, inode.raw_blkaddr),
            Kind::Char { major, minor } => (S_IFCHR, encode_dev(*major, *minor).expect("checked in add")),
            Kind::Block { major, minor } => (S_IFBLK, encode_dev(*major, *minor).expect("checked in add")),
            Kind::Fifo => (S_IFIFO, 0),
            Kind::Socket => (S_IFSOCK, 0),
        };
        let layout = if inode.inline { FLAT_INLINE } else { FLAT_PLAIN };
        // `erofs_xattr_ibody_size()` = 12 + 4 * (i_xattr_icount - 1); ibody is at most 4032.
        let icount = if inode.ibody == 0 { 0 } else { ((inode.ibody - XATTR_HEADER) / XATTR_ENTRY + 1) as u16 };
        let mut b = Vec::with_capacity((INODE_SIZE + inode.ibody) as usize + tail.len());
        b.extend_from_slice(&(LAYOUT_EXTENDED | layout << 1).to_le_bytes()); // i_format
        b.extend_from_slice(&icount.to_le_bytes()); // i_xattr_icount
        b.extend_from_slice(&((file_fmt | (node.meta.mode & 0o7777)) as u16).to_le_bytes()); // i_mode
        b.extend_from_slice(&[0; 2]); // i_reserved
        b.extend_from_slice(&inode.size.to_le_bytes()); // i_size
        b.extend_from_slice(&i_u.to_le_bytes()); // i_u: raw_blkaddr or rdev
        b.extend_from_slice(&(i as u32 + 1).to_le_bytes()); // i_ino
        b.extend_from_slice(&node.meta.uid.to_le_bytes()); // i_uid
        b.extend_from_slice(&node.meta.gid.to_le_bytes()); // i_gid
        b.extend_from_slice(&node.meta.mtime.to_le_bytes()); // i_mtime
        b.extend_from_slice(&[0; 4]); // i_mtime_nsec
        b.extend_from_slice(&inode.nlink.to_le_bytes()); // i_nlink
        b.extend_from_slice(&[0; 16]); // i_reserved2
        if !inode.xattrs.is_empty() {
            // erofs_xattr_ibody_header: no shared xattrs.
            b.extend_from_slice(&[0; XATTR_HEADER as usize]);
            for x in &inode.xattrs {
                b.push(x.suffix.len() as u8); // e_name_len
                b.push(x.index); // e_name_index
                b.extend_from_slice(&(x.value.len() as u16).to_le_bytes()); // e_value_size
                b.extend_from_slice(x.suffix);
                b.extend_from_slice(x.value);
                b.resize(b.len().next_multiple_of(XATTR_ENTRY as usize), 0);
            }
        }
        debug_assert_eq!(b.len() as u64, INODE_SIZE + inode.ibody);
        b.extend_from_slice(tail);
        b
    }

    /// Inode `i`'s path, by the names it was first reached by.
    fn path(&self, mut i: usize) -> String {
        let mut names = Vec::new();
        while i != 0 {
            names.push(self.inodes[i].name);
            i = self.inodes[i].parent;
        }
        if names.is_empty() {
            return "/".into();
        }
        names.iter().rev().map(|name| format!("/{}", String::from_utf8_lossy(name))).collect()
    }

    fn child_path(&self, dir: usize, name: &[u8]) -> String {
        let parent = if dir == 0 { String::new() } else { self.path(dir) };
        format!("{parent}/{}", String::from_utf8_lossy(name))
    }
}

fn too_big(blocks: u64) -> io::Error {
    invalid(format!("the image would take {blocks} blocks; erofs block addresses have 32 bits (16 TiB)"))
}

/// A name the kernel can list and look up: 1 to `EROFS_NAME_LEN` bytes, no `/` or NUL (a NUL
/// would end it early), not `.` or `..` (those are written for every directory).
fn check_name(name: &[u8]) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_LEN {
        return Err(format!("a name must have 1 to {NAME_LEN} bytes (this has {})", name.len()));
    }
    if name.contains(&b'/') || name.contains(&0) {
        return Err("a name cannot hold `/` or NUL".into());
    }
    if name == b"." || name == b".." {
        return Err("`.` and `..` cannot be entries".into());
    }
    Ok(())
}

/// `EROFS_XATTR_INDEX_*` and the rest of the name, for the prefixes erofs indexes; `None`
/// for others and for a bare prefix (the kernel's handlers never look such a name up).
fn xattr_index(name: &[u8]) -> Option<(u8, &[u8])> {
    XATTR_PREFIXES.iter().find_map(|&(prefix, index)| {
        name.strip_prefix(prefix).filter(|suffix| !suffix.is_empty()).map(|suffix| (index, suffix))
    })
}

/// The kernel's `new_encode_dev()`, which `erofs_read_inode` undoes with `new_decode_dev()`:
/// minor bits 0-7, major bits 8-19, minor bits 8-19 in bits 20-31.
fn encode_dev(major: u32, minor: u32) -> Option<u32> {
    (major <= 0xfff && minor <= 0xf_ffff).then_some((minor & 0xff) | (major << 8) | ((minor & !0xff) << 12))
}

/// `EROFS_FT_*` (the generic `FT_*` values).
fn file_type(kind: &Kind) -> u8 {
    match kind {
        Kind::File(_) => 1,
        Kind::Dir(_) => 2,
        Kind::Char { .. } => 3,
        Kind::Block { .. } => 4,
        Kind::Fifo => 5,
        Kind::Socket => 6,
        Kind::Symlink(_) => 7,
    }
}

/// Splits sorted dirents into directory blocks, as many per block as fit: each block's
/// entries and the bytes they take (`erofs_dirent`s and names).
fn dir_blocks(ents: &[(&[u8], usize)]) -> Vec<(Range<usize>, usize)> {
    let mut blocks = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (k, (name, _)) in ents.iter().enumerate() {
        let need = DIRENT + name.len();
        if used + need > BLOCK {
            blocks.push((start..k, used));
            (start, used) = (k, 0);
        }
        used += need;
    }
    blocks.push((start..ents.len(), used));
    blocks
}

/// Collects the metadata area one block at a time: inodes come in increasing offsets, and
/// none crosses a block.
struct MetaWriter<'f> {
    out: &'f File,
    blk: u64,
    buf: Vec<u8>,
}

impl MetaWriter<'_> {
    fn put(&mut self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let blk = offset / BLK;
        if blk != self.blk {
            self.flush()?;
            self.blk = blk;
            self.buf.fill(0);
        }
        let at = (offset % BLK) as usize;
        self.buf[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.write_all_at(&self.buf, self.blk * BLK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{Meta, Node};
    use std::collections::{BTreeMap, BTreeSet, HashSet};
    use std::ffi::{CString, OsStr};
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    use std::path::{Path, PathBuf};
    use std::process::Command;

    const T: i64 = 1_700_000_000;

    struct Builder(Tree);

    impl Builder {
        fn new() -> Self {
            Builder(Tree::new(tempfile::tempfile().unwrap()))
        }

        fn link(&mut self, parent: NodeId, name: &[u8], id: NodeId) {
            assert!(self.0.entries_mut(parent).unwrap().insert(name.to_vec(), id).is_none());
        }

        fn add(&mut self, parent: NodeId, name: &[u8], meta: Meta, kind: Kind) -> NodeId {
            let id = self.0.add(Node { meta, kind });
            self.link(parent, name, id);
            id
        }

        fn dir(&mut self, parent: NodeId, name: &[u8], mode: u32) -> NodeId {
            self.add(parent, name, Meta::new(mode, 0, 0, T + 1), Kind::Dir(BTreeMap::new()))
        }

        fn file(&mut self, parent: NodeId, name: &[u8], meta: Meta, data: &[u8]) -> NodeId {
            let extent = self.0.append_content(&mut &data[..], data.len() as u64).unwrap();
            self.add(parent, name, meta, Kind::File(extent))
        }

        fn special(&mut self, parent: NodeId, name: &[u8], kind: Kind) -> NodeId {
            self.add(parent, name, Meta::new(0o644, 0, 0, T), kind)
        }
    }

    fn pattern(len: usize, seed: u32) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    /// Everything the brief lists: every node kind, odd sizes, owners, modes, hard links,
    /// devices, xattrs and a directory of 300 entries.
    fn sample() -> Tree {
        let mut b = Builder::new();
        b.0.node_mut(ROOT).meta = Meta::new(0o755, 0, 0, T);
        let etc = b.dir(ROOT, b"etc", 0o755);
        b.file(etc, b"hostname", Meta::new(0o644, 0, 0, T), &pattern(100, 1));
        b.file(etc, b"shadow", Meta::new(0o640, 1000, 1000, T - 5), b"root:*:19000::::::\n");
        let usr = b.dir(ROOT, b"usr", 0o755);
        let bin = b.dir(usr, b"bin", 0o755);
        b.file(bin, b"su", Meta::new(0o4755, 0, 0, T), &pattern(4097, 2));
        b.file(bin, b"wall", Meta::new(0o2755, 0, 5, T), &pattern(3000, 3));
        let mut deep = b.dir(usr, b"lib", 0o755);
        for name in [&b"a"[..], b"b", b"c"] {
            deep = b.dir(deep, name, 0o700);
        }
        b.file(deep, b"leaf", Meta::new(0o600, 0, 0, -1), b"leaf\n");

        let data = b.dir(ROOT, b"data", 0o750);
        b.file(data, b"empty", Meta::new(0o644, 0, 0, T), b"");
        b.file(data, b"hundred", Meta::new(0o644, 0, 0, T), &pattern(100, 4));
        b.file(data, b"page", Meta::new(0o644, 0, 0, T), &pattern(4096, 5));
        b.file(data, b"page+1", Meta::new(0o644, 0, 0, T), &pattern(4097, 6));
        b.file(data, b"big", Meta::new(0o644, 0, 0, T), &pattern(3 * 1024 * 1024 + 123, 7));
        b.file(data, b"uid70000", Meta::new(0o600, 70000, 70001, T), b"far\n");
        b.file(data, b"two-blocks", Meta::new(0o644, 0, 0, T), &pattern(8192, 8));
        let linked = b.file(data, b"hard1", Meta::new(0o644, 0, 0, T), &pattern(5000, 9));
        let sub = b.dir(data, b"sub", 0o755);
        b.link(sub, b"hard2", linked);
        b.link(data, b"hard3", linked);

        let links = b.dir(ROOT, b"links", 0o755);
        b.special(links, b"short", Kind::Symlink(b"../data/hundred".to_vec()));
        let long: Vec<u8> = (0..300).map(|i| if i % 10 == 9 { b'/' } else { b'a' + (i % 26) as u8 }).collect();
        b.special(links, b"long", Kind::Symlink(long));
        b.special(links, b"dangling", Kind::Symlink(b"/nowhere/at/all".to_vec()));

        let dev = b.dir(ROOT, b"dev", 0o755);
        b.special(dev, b"null", Kind::Char { major: 1, minor: 3 });
        b.special(dev, b"tty300", Kind::Char { major: 4, minor: 300 });
        b.special(dev, b"max", Kind::Char { major: 0xfff, minor: 0xf_ffff });
        b.special(dev, b"sda1", Kind::Block { major: 8, minor: 1 });
        b.special(dev, b"fifo", Kind::Fifo);
        b.special(dev, b"sock", Kind::Socket);

        let x = b.dir(ROOT, b"xattrs", 0o755);
        let mut meta = Meta::new(0o755, 0, 0, T);
        meta.xattrs.insert(b"user.test".to_vec(), b"hello".to_vec());
        // vfs_cap_data revision 2, effective, CAP_NET_BIND_SERVICE permitted: the kernel's
        // commoncap parses this xattr on reads, so it must be well formed.
        let cap = [[0x01, 0, 0, 0x02], [0, 0x04, 0, 0], [0; 4], [0; 4], [0; 4]].concat();
        meta.xattrs.insert(b"security.capability".to_vec(), cap);
        meta.xattrs.insert(b"trusted.overlay.opaque".to_vec(), b"y".to_vec());
        meta.xattrs.insert(b"user.empty".to_vec(), Vec::new());
        meta.xattrs.insert(b"system.posix_acl_access".to_vec(), vec![2, 0, 0, 0]);
        meta.xattrs.insert(b"other.thing".to_vec(), b"x".to_vec());
        b.file(x, b"ping", meta, &pattern(50, 11));
        let mut meta = Meta::new(0o777, 0, 0, T);
        meta.xattrs.insert(b"security.selinux".to_vec(), b"system_u:object_r:bin_t:s0\0".to_vec());
        b.add(x, b"link", meta, Kind::Symlink(b"ping".to_vec()));
        let mut meta = Meta::new(0o755, 0, 0, T);
        meta.xattrs.insert(b"user.big".to_vec(), pattern(3000, 12));
        let xdir = b.add(x, b"dir", meta, Kind::Dir(BTreeMap::new()));
        b.file(xdir, b"inside", Meta::new(0o644, 0, 0, T), b"in");
        // Xattrs leave no room for the tail in the inode's block: data blocks instead.
        let mut meta = Meta::new(0o777, 0, 0, T);
        meta.xattrs.insert(b"trusted.big".to_vec(), pattern(3500, 13));
        let target: Vec<u8> = (0..1500).map(|i| b'a' + (i % 26) as u8).collect();
        b.add(x, b"slow-link", meta, Kind::Symlink(target));
        let mut meta = Meta::new(0o644, 0, 0, T);
        meta.xattrs.insert(b"security.big".to_vec(), pattern(3900, 14));
        b.file(x, b"crowded", meta, &pattern(6000, 15));

        b.dir(ROOT, b"tmp", 0o1777);

        // 300 entries of all kinds, names up to 255 bytes, some sorting before `.` and `..`.
        let many = b.dir(ROOT, b"many", 0o755);
        for i in 0..300usize {
            let mut name = format!("{i:03}-").into_bytes();
            name.resize((4 + i * 37 % 252).min(255), b'a' + (i % 26) as u8);
            match i % 5 {
                0 => {
                    b.dir(many, &name, 0o755);
                }
                1 => {
                    b.special(many, &name, Kind::Symlink(format!("target-{i}").into_bytes()));
                }
                _ => {
                    b.file(many, &name, Meta::new(0o644, i as u32, 0, T + i as i64), &pattern(i * 13, i as u32));
                }
            }
        }
        for name in [&b"!bang"[..], b"-dash", b"+plus", b"--", b"...", b".hidden", b"~", &[b'z'; 255]] {
            b.file(many, name, Meta::new(0o644, 0, 0, T), name);
        }

        // Not reachable: a node nobody names, and one whose name was removed.
        b.0.add(Node { meta: Meta::new(0o644, 0, 0, T), kind: Kind::Fifo });
        let gone = b.file(ROOT, b"gone", Meta::new(0o644, 0, 0, T), b"gone");
        b.0.entries_mut(ROOT).unwrap().remove(&b"gone"[..]);
        assert!(gone > 0);
        b.0
    }

    /// Names with high bytes and spaces, an empty directory, a chain of 100 directories.
    fn hostile() -> Tree {
        let mut b = Builder::new();
        let odd = b.dir(ROOT, b"odd names", 0o755);
        b.file(odd, &[0x80, 0xff, b' ', 0xc3, 0x28], Meta::new(0o644, 0, 0, T), b"high");
        b.file(odd, b" leading space", Meta::new(0o644, 0, 0, T), b"sp");
        b.file(odd, b"trailing space ", Meta::new(0o644, 0, 0, T), b"sp2");
        let high: Vec<u8> = (0x80..=0xffu8).collect();
        b.file(odd, &high, Meta::new(0o644, 0, 0, T), &high);
        b.dir(odd, b"empty", 0o555);
        let mut dir = ROOT;
        for depth in 0..100 {
            dir = b.dir(dir, format!("d{depth}").as_bytes(), 0o755);
        }
        b.file(dir, b"bottom", Meta::new(0o644, 0, 0, T), b"deep");
        b.0
    }

    fn opts() -> Options {
        Options { uuid: *b"0123456789abcdef", volume_name: "umbra-test".into(), build_time: T }
    }

    fn image(tree: &Tree) -> (tempfile::NamedTempFile, Stats) {
        let img = tempfile::NamedTempFile::new().unwrap();
        let stats = write(tree, img.as_file(), &opts()).unwrap();
        (img, stats)
    }

    /// Every reachable (path, node) pair, and how many names each node has.
    fn reachable(tree: &Tree, root: &Path) -> (Vec<(PathBuf, NodeId)>, HashMap<NodeId, u32>) {
        let mut all = vec![(root.to_path_buf(), ROOT)];
        let mut names = HashMap::from([(ROOT, 1)]);
        let mut stack = vec![(root.to_path_buf(), ROOT)];
        while let Some((path, dir)) = stack.pop() {
            for (name, &child) in tree.entries(dir).unwrap() {
                let child_path = path.join(OsStr::from_bytes(name));
                *names.entry(child).or_default() += 1;
                all.push((child_path.clone(), child));
                if tree.entries(child).is_some() {
                    stack.push((child_path, child));
                }
            }
        }
        (all, names)
    }

    fn content(tree: &Tree, node: NodeId) -> Vec<u8> {
        let Kind::File(extent) = tree.node(node).kind else { panic!("not a file") };
        let mut buf = vec![0; extent.len as usize];
        tree.read_content(extent, 0, &mut buf).unwrap();
        buf
    }

    fn fsck(img: &Path, extra: &[&str]) -> String {
        let out = Command::new("fsck.erofs")
            .args(extra)
            .arg(img)
            .output()
            .expect("fsck.erofs must be installed (scripts/install-deps installs erofs-utils)");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "fsck.erofs {extra:?} failed: {text}");
        text
    }

    #[test]
    fn fsck_passes_and_extracts_the_same_tree() {
        for tree in [sample(), hostile()] {
            let (img, _) = image(&tree);
            fsck(img.path(), &[]);
            let dir = tempfile::tempdir().unwrap();
            let to = dir.path().join("x");
            fsck(img.path(), &[&format!("--extract={}", to.display())]);
            let (all, _) = reachable(&tree, &to);
            for (path, id) in &all {
                let md = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
                let meta = &tree.node(*id).meta;
                // As root, fsck.erofs 1.5 restores owners, times and permissions (not setuid
                // and setgid: it chowns after chmod).
                if is_root() {
                    assert_eq!((md.uid(), md.gid(), md.mtime()), (meta.uid, meta.gid, meta.mtime), "{path:?}");
                    if !md.is_symlink() {
                        assert_eq!(md.mode() & 0o1777, meta.mode & 0o1777, "{path:?}");
                    }
                    if let Kind::Char { major, minor } | Kind::Block { major, minor } = tree.node(*id).kind {
                        assert_eq!((libc::major(md.rdev()), libc::minor(md.rdev())), (major, minor), "{path:?}");
                    }
                }
                match &tree.node(*id).kind {
                    Kind::Dir(entries) => {
                        assert!(md.is_dir(), "{path:?}");
                        let listed: BTreeSet<Vec<u8>> = std::fs::read_dir(path)
                            .unwrap()
                            .map(|e| e.unwrap().file_name().as_bytes().to_vec())
                            .collect();
                        assert_eq!(listed, entries.keys().cloned().collect(), "{path:?}");
                    }
                    Kind::File(_) => assert_eq!(std::fs::read(path).unwrap(), content(&tree, *id), "{path:?}"),
                    Kind::Symlink(target) => {
                        assert_eq!(std::fs::read_link(path).unwrap().as_os_str().as_bytes(), target)
                    }
                    Kind::Char { .. } => assert!(md.file_type().is_char_device(), "{path:?}"),
                    Kind::Block { .. } => assert!(md.file_type().is_block_device(), "{path:?}"),
                    Kind::Fifo => assert!(md.file_type().is_fifo(), "{path:?}"),
                    Kind::Socket => assert!(md.file_type().is_socket(), "{path:?}"),
                }
            }
        }
    }

    /// Loop-mounts an image read-only, if this host can; unmounts when dropped.
    struct Mounted(tempfile::TempDir);

    impl Drop for Mounted {
        fn drop(&mut self) {
            let ok = Command::new("umount").arg(self.0.path()).status().is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(self.0.path()).status();
            }
        }
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    fn mount(img: &Path) -> Option<Mounted> {
        if !is_root() {
            eprintln!("mount check skipped: not root");
            return None;
        }
        let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !filesystems.lines().any(|line| line.split_whitespace().last() == Some("erofs")) {
            eprintln!("mount check skipped: this kernel has no erofs");
            return None;
        }
        if !Path::new("/dev/loop-control").exists() {
            eprintln!("mount check skipped: no loop devices");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let out =
            Command::new("mount").args(["-o", "loop,ro", "-t", "erofs"]).arg(img).arg(dir.path()).output().unwrap();
        assert!(out.status.success(), "mount failed (see dmesg): {}", String::from_utf8_lossy(&out.stderr));
        Some(Mounted(dir))
    }

    fn cpath(path: &Path) -> CString {
        CString::new(path.as_os_str().as_bytes()).unwrap()
    }

    fn getxattr(path: &Path, name: &[u8]) -> Option<Vec<u8>> {
        let (path, name) = (cpath(path), CString::new(name).unwrap());
        let mut buf = vec![0u8; 1 << 16];
        // SAFETY: both strings are NUL-terminated and `buf` is writable for its whole length.
        let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        let n = usize::try_from(n).ok()?;
        buf.truncate(n);
        Some(buf)
    }

    fn listxattr(path: &Path) -> BTreeSet<Vec<u8>> {
        let path = cpath(path);
        let mut buf = vec![0u8; 1 << 16];
        // SAFETY: `path` is NUL-terminated and `buf` is writable for its whole length.
        let n = unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        let n = usize::try_from(n).unwrap_or_else(|_| panic!("llistxattr {path:?}: {}", io::Error::last_os_error()));
        buf[..n].split(|&b| b == 0).filter(|name| !name.is_empty()).map(<[u8]>::to_vec).collect()
    }

    /// The inode numbers `readdir` gives for `.` and `..` (std's `read_dir` leaves them out).
    fn dot_inos(dir: &Path) -> (u64, u64) {
        let path = cpath(dir);
        let (mut dot, mut dotdot) = (None, None);
        // SAFETY: `path` is NUL-terminated; each dirent is read before the next readdir call,
        // and the stream is closed once, after the last.
        unsafe {
            let stream = libc::opendir(path.as_ptr());
            assert!(!stream.is_null(), "opendir {dir:?}");
            loop {
                let entry = libc::readdir(stream);
                if entry.is_null() {
                    break;
                }
                match std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()).to_bytes() {
                    b"." => dot = Some((*entry).d_ino),
                    b".." => dotdot = Some((*entry).d_ino),
                    _ => {}
                }
            }
            libc::closedir(stream);
        }
        (dot.expect("a `.` entry"), dotdot.expect("a `..` entry"))
    }

    fn same_kind(ft: std::fs::FileType, kind: &Kind) -> bool {
        match kind {
            Kind::Dir(_) => ft.is_dir(),
            Kind::File(_) => ft.is_file(),
            Kind::Symlink(_) => ft.is_symlink(),
            Kind::Char { .. } => ft.is_char_device(),
            Kind::Block { .. } => ft.is_block_device(),
            Kind::Fifo => ft.is_fifo(),
            Kind::Socket => ft.is_socket(),
        }
    }

    /// Checks the mounted image at `root` shows exactly `tree`, through the kernel's erofs.
    fn check_mounted(tree: &Tree, root: &Path) {
        let (all, names) = reachable(tree, root);
        let mut inos: HashMap<NodeId, u64> = HashMap::new();
        for (path, id) in &all {
            let node = tree.node(*id);
            // A lookup of every name (erofs_namei's binary search over blocks, then dirents).
            let md = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
            assert!(same_kind(md.file_type(), &node.kind), "{path:?}: {:?}", md.file_type());
            assert_eq!(md.mode() & 0o7777, node.meta.mode, "{path:?}: mode");
            assert_eq!((md.uid(), md.gid()), (node.meta.uid, node.meta.gid), "{path:?}: owner");
            assert_eq!(md.mtime(), node.meta.mtime, "{path:?}: mtime");
            assert_eq!(*inos.entry(*id).or_insert(md.ino()), md.ino(), "{path:?}: hard links share an inode");
            match &node.kind {
                Kind::Dir(entries) => {
                    let subdirs = entries.values().filter(|&&c| tree.entries(c).is_some()).count();
                    assert_eq!(md.nlink(), 2 + subdirs as u64, "{path:?}: nlink");
                    let mut listed = BTreeMap::new();
                    for entry in std::fs::read_dir(path).unwrap() {
                        let entry = entry.unwrap();
                        let name = entry.file_name().as_bytes().to_vec();
                        assert!(listed.insert(name, entry.file_type().unwrap()).is_none(), "{path:?}: listed twice");
                    }
                    assert_eq!(listed.keys().collect::<Vec<_>>(), entries.keys().collect::<Vec<_>>(), "{path:?}");
                    for (name, ft) in &listed {
                        assert!(same_kind(*ft, &tree.node(entries[name]).kind), "{path:?}: d_type of {name:?}");
                    }
                    let parent =
                        if path == root { md.ino() } else { std::fs::metadata(path.join("..")).unwrap().ino() };
                    assert_eq!(dot_inos(path), (md.ino(), parent), "{path:?}: `.` and `..`");
                    // Names that are not there, sorting right after and before each one that is.
                    for name in entries.keys().filter(|name| name.len() < NAME_LEN) {
                        for probe in [[name.as_slice(), b"\x01"].concat(), name[..name.len() - 1].to_vec()] {
                            if ![&b""[..], b".", b".."].contains(&probe.as_slice()) && !entries.contains_key(&probe) {
                                let err = std::fs::symlink_metadata(path.join(OsStr::from_bytes(&probe))).unwrap_err();
                                assert_eq!(err.kind(), io::ErrorKind::NotFound, "{path:?}: {probe:?}");
                            }
                        }
                    }
                }
                Kind::File(extent) => {
                    assert_eq!(md.len(), extent.len, "{path:?}: size");
                    assert!(std::fs::read(path).unwrap() == content(tree, *id), "{path:?}: contents");
                }
                Kind::Symlink(target) => {
                    assert_eq!(md.len(), target.len() as u64, "{path:?}: size");
                    assert_eq!(std::fs::read_link(path).unwrap().as_os_str().as_bytes(), target, "{path:?}");
                }
                Kind::Char { major, minor } | Kind::Block { major, minor } => {
                    assert_eq!((libc::major(md.rdev()), libc::minor(md.rdev())), (*major, *minor), "{path:?}: rdev");
                }
                Kind::Fifo | Kind::Socket => {}
            }
            if tree.entries(*id).is_none() {
                assert_eq!(md.nlink(), u64::from(names[id]), "{path:?}: nlink");
            }
            let kept: BTreeSet<Vec<u8>> =
                node.meta.xattrs.keys().filter(|name| xattr_index(name).is_some()).cloned().collect();
            assert_eq!(listxattr(path), kept, "{path:?}: xattr names");
            for (name, value) in &node.meta.xattrs {
                let got = getxattr(path, name);
                if kept.contains(name) {
                    assert_eq!(got.as_ref(), Some(value), "{path:?}: xattr {name:?}");
                } else {
                    assert_eq!(got, None, "{path:?}: skipped xattr {name:?}");
                }
            }
        }
        let distinct: HashSet<u64> = inos.values().copied().collect();
        assert_eq!(distinct.len(), inos.len(), "one inode per node");
    }

    #[test]
    fn the_kernel_mounts_exactly_the_tree() {
        for tree in [sample(), hostile()] {
            let (img, _) = image(&tree);
            let Some(mounted) = mount(img.path()) else { return };
            check_mounted(&tree, mounted.0.path());
        }
    }

    #[test]
    fn same_tree_same_bytes() {
        let tree = sample();
        let (first, stats) = image(&tree);
        // Stale bytes, beyond the image and in it, must not survive.
        let second = tempfile::NamedTempFile::new().unwrap();
        second.as_file().write_all_at(&vec![0xa5; stats.bytes as usize + 12345], 0).unwrap();
        assert_eq!(write(&tree, second.as_file(), &opts()).unwrap(), stats);
        let (a, b) = (std::fs::read(first.path()).unwrap(), std::fs::read(second.path()).unwrap());
        assert_eq!(a.len(), b.len());
        assert!(a == b, "two writes of one tree differ");
    }

    fn le16(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
    }

    fn le32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    fn le64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn stats_and_superblock() {
        let tree = sample();
        let img = tempfile::NamedTempFile::new().unwrap();
        let uuid = *b"\x01\x23\x45\x67\x89\xab\xcd\xef\xfe\xdc\xba\x98\x76\x54\x32\x10";
        let opts = Options { uuid, volume_name: "abéééééééé".into(), build_time: -3 };
        let stats = write(&tree, img.as_file(), &opts).unwrap();
        let bytes = std::fs::read(img.path()).unwrap();
        let (_, names) = reachable(&tree, Path::new("/"));
        assert_eq!(stats.inodes, names.len() as u64, "reachable nodes only, hard links once");
        assert_eq!(stats.skipped_xattrs, 2, "system.posix_acl_access and other.thing");
        assert_eq!(stats.bytes, bytes.len() as u64);
        assert_eq!(stats.blocks * 4096, stats.bytes);
        assert!(stats.bytes > 3 * 1024 * 1024 && stats.bytes < 4 * 1024 * 1024, "{stats:?}");

        let sb = &bytes[1024..1152];
        assert_eq!(le32(sb, 0), 0xE0F5_E1E2);
        assert_eq!(le32(sb, 4), 0, "no checksum");
        assert_eq!(sb[12], 12, "4 KiB blocks");
        assert_eq!(le16(sb, 14), 36, "root nid");
        assert_eq!(le64(sb, 16), stats.inodes);
        assert_eq!(le64(sb, 24) as i64, -3);
        assert_eq!(u64::from(le32(sb, 36)), stats.blocks);
        assert_eq!(le32(sb, 40), 0, "meta_blkaddr");
        assert_eq!(&sb[48..64], &uuid);
        assert_eq!(&sb[64..80], "abéééééé\0\0".as_bytes(), "cut to 15 bytes at a character boundary");
        assert_eq!(le32(sb, 80), 0, "no incompatible features");
        assert_eq!(sb[90], 0, "dirblkbits");

        // The root: an extended inode with FLAT_INLINE data in slot 36.
        let root = &bytes[1152..1216];
        assert_eq!(le16(root, 0), 1 | FLAT_INLINE << 1);
        assert_eq!(u32::from(le16(root, 4)), S_IFDIR | 0o755);
        assert_eq!(le32(root, 44), 2 + 8, "root nlink: 8 subdirectories");
    }

    #[test]
    fn rejects_what_erofs_cannot_hold() {
        type Setup = fn(&mut Builder);
        let cases: [(Setup, &str); 10] = [
            (
                |b| {
                    b.file(ROOT, b"a/b", Meta::new(0o644, 0, 0, T), b"");
                },
                "/a/b: a name cannot hold",
            ),
            (
                |b| {
                    b.file(ROOT, &[b'n'; 256], Meta::new(0o644, 0, 0, T), b"");
                },
                "must have 1 to 255 bytes",
            ),
            (
                |b| {
                    let mut meta = Meta::new(0o644, 0, 0, T);
                    meta.xattrs.insert(b"user.huge".to_vec(), vec![1; 4020]);
                    let d = b.dir(ROOT, b"d", 0o755);
                    b.file(d, b"f", meta, b"");
                },
                "/d/f: its xattrs take 4040 bytes; at most 4032 fit",
            ),
            (
                |b| {
                    let mut meta = Meta::new(0o644, 0, 0, T);
                    meta.xattrs.insert([&b"user."[..], &[b'n'; 256]].concat(), vec![1]);
                    b.file(ROOT, b"f", meta, b"");
                },
                "/f: xattr name user.nnn",
            ),
            (
                |b| {
                    b.special(ROOT, b"dev", Kind::Char { major: 4096, minor: 0 });
                },
                "/dev: device 4096:0",
            ),
            (
                |b| {
                    b.special(ROOT, b"dev", Kind::Block { major: 0, minor: 1 << 20 });
                },
                "/dev: device 0:1048576",
            ),
            (
                |b| {
                    b.special(ROOT, b"l", Kind::Symlink(Vec::new()));
                },
                "/l: a symlink target must have 1 to 4095",
            ),
            (
                |b| {
                    b.special(ROOT, b"l", Kind::Symlink(vec![b'a'; 4096]));
                },
                "(it has 4096)",
            ),
            (
                |b| {
                    let d = b.dir(ROOT, b"d", 0o755);
                    let e = b.dir(d, b"e", 0o755);
                    b.link(e, b"up", d);
                },
                "/d/e/up: directory /d has a second name",
            ),
            (|b| b.0.node_mut(ROOT).kind = Kind::Fifo, "the root is not a directory"),
        ];
        for (setup, message) in cases {
            let mut b = Builder::new();
            setup(&mut b);
            let out = tempfile::tempfile().unwrap();
            let err = write(&b.0, &out, &opts()).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
            assert!(err.to_string().contains(message), "{err:?} does not say {message:?}");
        }
    }

    #[test]
    fn devices_encode_as_new_encode_dev() {
        assert_eq!(encode_dev(1, 3), Some(0x103));
        assert_eq!(encode_dev(4, 300), Some(0x0010_042c));
        assert_eq!(encode_dev(0xfff, 0xf_ffff), Some(u32::MAX));
        assert_eq!(encode_dev(0x1000, 0), None);
    }
}
