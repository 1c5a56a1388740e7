//! A root filesystem held as a tree of nodes, built by applying image layers and read by the
//! erofs writer. Nothing in it ever exists on the host's filesystem as what it describes: a
//! setuid-root file, a device node or a symlink to `/` are only records here and bytes in the
//! image, so an image's contents cannot touch the host while it is converted (and a user
//! without root converts images with exact ownership). File contents are appended to one
//! spill file and named by their extent in it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;

/// Index of a node in its [`Tree`].
pub type NodeId = usize;

/// The root directory's id.
pub const ROOT: NodeId = 0;

/// Metadata every node has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Permission bits with setuid, setgid and sticky (`0o7777`); the type is in [`Kind`].
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    /// Full names (`user.foo`, `security.capability`) to values.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Meta {
    pub fn new(mode: u32, uid: u32, gid: u32, mtime: i64) -> Self {
        Meta { mode: mode & 0o7777, uid, gid, mtime, xattrs: BTreeMap::new() }
    }
}

/// Where a regular file's bytes are in the tree's spill file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Names (one path component each, never `.`, `..`, empty or with a `/` or NUL) to nodes.
    /// Two names for one node are hard links; a directory is named once.
    Dir(BTreeMap<Vec<u8>, NodeId>),
    File(Extent),
    Symlink(Vec<u8>),
    Char {
        major: u32,
        minor: u32,
    },
    Block {
        major: u32,
        minor: u32,
    },
    Fifo,
    Socket,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub meta: Meta,
    pub kind: Kind,
}

/// A tree whose root is [`ROOT`]. Nodes a layer removed stay in the arena, unreachable:
/// readers walk from the root.
#[derive(Debug)]
pub struct Tree {
    nodes: Vec<Node>,
    content: File,
    content_len: u64,
}

impl Tree {
    /// An empty root directory (0755, root-owned); file contents go to `content`, which should
    /// be an empty, unlinked temporary file.
    pub fn new(content: File) -> Self {
        let root = Node { meta: Meta::new(0o755, 0, 0, 0), kind: Kind::Dir(BTreeMap::new()) };
        Tree { nodes: vec![root], content, content_len: 0 }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id]
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id]
    }

    /// Adds a node nobody names yet.
    pub fn add(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// The entries of directory `dir` (None when it is not a directory).
    pub fn entries(&self, dir: NodeId) -> Option<&BTreeMap<Vec<u8>, NodeId>> {
        match &self.nodes[dir].kind {
            Kind::Dir(entries) => Some(entries),
            _ => None,
        }
    }

    pub fn entries_mut(&mut self, dir: NodeId) -> Option<&mut BTreeMap<Vec<u8>, NodeId>> {
        match &mut self.nodes[dir].kind {
            Kind::Dir(entries) => Some(entries),
            _ => None,
        }
    }

    /// Copies exactly `len` bytes from `from` into the spill file.
    pub fn append_content(&mut self, from: &mut dyn Read, len: u64) -> io::Result<Extent> {
        let offset = self.content_len;
        let mut writer = OffsetWriter { file: &self.content, at: offset };
        let copied = io::copy(&mut from.take(len), &mut writer)?;
        if copied != len {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("{copied} bytes of {len}")));
        }
        self.content_len += len;
        Ok(Extent { offset, len })
    }

    /// Reads `buf.len()` bytes of `extent` from `at` within it.
    pub fn read_content(&self, extent: Extent, at: u64, buf: &mut [u8]) -> io::Result<()> {
        if at.checked_add(buf.len() as u64).is_none_or(|end| end > extent.len) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "read past the extent"));
        }
        self.content.read_exact_at(buf, extent.offset + at)
    }

    /// Bytes of file contents kept (including those of files later removed).
    pub fn content_len(&self) -> u64 {
        self.content_len
    }
}

struct OffsetWriter<'a> {
    file: &'a File,
    at: u64,
}

impl Write for OffsetWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_round_trips_and_reads_stay_inside_their_extent() {
        let mut tree = Tree::new(tempfile::tempfile().unwrap());
        let a = tree.append_content(&mut &b"hello"[..], 5).unwrap();
        let b = tree.append_content(&mut &b"world!"[..], 6).unwrap();
        assert_eq!((a.offset, b.offset, tree.content_len()), (0, 5, 11));
        let mut buf = [0u8; 3];
        tree.read_content(b, 2, &mut buf).unwrap();
        assert_eq!(&buf, b"rld");
        assert!(tree.read_content(a, 3, &mut buf).is_err());
        assert!(tree.append_content(&mut &b"ab"[..], 3).is_err(), "a short source is an error");
    }
}
