//! Applying OCI layers (tar, gzip or zstd) to a [`Tree`], as the image spec's "applying
//! changesets" says: whiteouts (`.wh.NAME`) delete from the layers below, an opaque marker
//! (`.wh..wh..opq`) empties its directory of what the layers below put there, hard links name
//! an earlier node, and each entry's mode, owner, mtime and xattrs are kept exactly.
//!
//! A layer is untrusted input. Every path is resolved inside the tree: `..` is refused, a
//! symlink met on the way is followed within the root (`/` is the image's root, never the
//! host's), and no host path is ever formed from an entry's name. What a layer can make the
//! host hold is bounded ([`Limits`]).

use std::collections::{BTreeMap, HashSet};
use std::io::{self, Read};

use sha2::{Digest, Sha256};

use crate::tree::{Kind, Meta, Node, NodeId, Tree, ROOT};

const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";
/// Symlinks followed while resolving one path (the kernel's own limit).
const MAX_HOPS: usize = 40;

/// What one image may make the host keep while it is converted.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Entries over all layers.
    pub entries: u64,
    /// Bytes of file contents over all layers (also the spill file's size).
    pub content_bytes: u64,
    pub path_bytes: usize,
    pub xattr_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { entries: 4_000_000, content_bytes: 64 << 30, path_bytes: 4096, xattr_bytes: 64 << 10 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("layer {layer}: cannot read it: {source}")]
    Read { layer: usize, source: io::Error },
    #[error("layer {layer}: {path}: {reason}")]
    Entry { layer: usize, path: String, reason: String },
    #[error("layer {layer}: its uncompressed digest is sha256:{actual}, the image config says {expected}")]
    DiffId { layer: usize, expected: String, actual: String },
    #[error("the image is too large to convert: {0}")]
    TooLarge(String),
}

/// What applying the layers did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub entries: u64,
    pub whiteouts: u64,
    pub opaque: u64,
    pub hard_links: u64,
}

/// The layer's uncompressed bytes: gzip and zstd are recognised by their magic numbers
/// (media types say the same, but `docker save` archives and OCI layouts do not always).
pub fn decompress<'a>(mut raw: impl Read + 'a) -> io::Result<Box<dyn Read + 'a>> {
    let mut magic = [0u8; 4];
    let mut n = 0;
    while n < magic.len() {
        match raw.read(&mut magic[n..])? {
            0 => break,
            k => n += k,
        }
    }
    let head = io::Cursor::new(magic[..n].to_vec()).chain(raw);
    Ok(match magic[..n] {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::MultiGzDecoder::new(head)),
        [0x28, 0xb5, 0x2f, 0xfd] => Box::new(zstd::stream::read::Decoder::new(head)?),
        _ => Box::new(head),
    })
}

/// Reads through, hashing what it read.
struct Hashed<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for Hashed<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// Applies layers in order onto one tree.
pub struct Applier<'t> {
    tree: &'t mut Tree,
    limits: Limits,
    applied: Applied,
}

impl<'t> Applier<'t> {
    pub fn new(tree: &'t mut Tree, limits: Limits) -> Self {
        Applier { tree, limits, applied: Applied::default() }
    }

    pub fn applied(&self) -> &Applied {
        &self.applied
    }

    /// Applies layer number `layer` (for messages), whose compressed or plain bytes `raw`
    /// yields; `diff_id` is the sha256 (hex) its uncompressed tar must have, when known.
    pub fn apply(&mut self, layer: usize, raw: impl Read, diff_id: Option<&str>) -> Result<(), LayerError> {
        let read = |source| LayerError::Read { layer, source };
        let mut hashed = Hashed { inner: decompress(raw).map_err(read)?, hash: Sha256::new() };
        let mut fresh = HashSet::new();
        {
            let mut archive = tar::Archive::new(&mut hashed);
            for entry in archive.entries().map_err(read)? {
                let entry = entry.map_err(read)?;
                self.entry(layer, entry, &mut fresh)?;
            }
        }
        // The digest covers the whole stream, including the padding after the last entry.
        io::copy(&mut hashed, &mut io::sink()).map_err(read)?;
        let actual = hex::encode(hashed.hash.finalize());
        if let Some(expected) = diff_id {
            if expected != actual {
                return Err(LayerError::DiffId { layer, expected: format!("sha256:{expected}"), actual });
            }
        }
        Ok(())
    }

    fn entry(
        &mut self,
        layer: usize,
        mut entry: tar::Entry<'_, impl Read>,
        fresh: &mut HashSet<(NodeId, Vec<u8>)>,
    ) -> Result<(), LayerError> {
        let raw_path = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw_path).escape_debug().to_string();
        let bad = |reason: &str| LayerError::Entry { layer, path: shown.clone(), reason: reason.into() };
        self.applied.entries += 1;
        if self.applied.entries > self.limits.entries {
            return Err(LayerError::TooLarge(format!("more than {} entries", self.limits.entries)));
        }
        if raw_path.len() > self.limits.path_bytes {
            return Err(bad("the path is too long"));
        }
        let header = entry.header().clone();
        let kind = header.entry_type();
        if matches!(kind, tar::EntryType::XGlobalHeader) {
            return Ok(());
        }
        let parts = components(&raw_path).map_err(|r| bad(&r))?;
        let Some((name, dirs)) = parts.split_last() else {
            // The root itself ("./"): only its metadata.
            if kind.is_dir() {
                let meta = self.meta(&mut entry, &header).map_err(|r| bad(&r))?;
                self.tree.node_mut(ROOT).meta = meta;
            }
            return Ok(());
        };
        let parent = self.make_dirs(dirs, &header).map_err(|r| bad(&r))?;
        if name.starts_with(WHITEOUT) {
            if name.as_slice() == OPAQUE {
                self.applied.opaque += 1;
                let entries = self.tree.entries_mut(parent).ok_or_else(|| bad("not in a directory"))?;
                entries.retain(|child, _| fresh.contains(&(parent, child.clone())));
            } else {
                self.applied.whiteouts += 1;
                let target = name[WHITEOUT.len()..].to_vec();
                check_name(&target).map_err(|r| bad(&r))?;
                if !fresh.contains(&(parent, target.clone())) {
                    self.tree.entries_mut(parent).ok_or_else(|| bad("not in a directory"))?.remove(&target);
                }
            }
            return Ok(());
        }
        let meta = self.meta(&mut entry, &header).map_err(|r| bad(&r))?;
        let existing = self.tree.entries(parent).and_then(|e| e.get(name)).copied();
        let node = match kind {
            tar::EntryType::Directory => {
                if let Some(id) = existing.filter(|id| self.tree.entries(*id).is_some()) {
                    // A directory again: new metadata, the same contents.
                    self.tree.node_mut(id).meta = meta;
                    fresh.insert((parent, name.clone()));
                    return Ok(());
                }
                self.tree.add(Node { meta, kind: Kind::Dir(BTreeMap::new()) })
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let len = entry.size();
                if self.tree.content_len().saturating_add(len) > self.limits.content_bytes {
                    return Err(LayerError::TooLarge(format!(
                        "more than {} bytes of files",
                        self.limits.content_bytes
                    )));
                }
                let extent =
                    self.tree.append_content(&mut entry, len).map_err(|e| LayerError::Read { layer, source: e })?;
                self.tree.add(Node { meta, kind: Kind::File(extent) })
            }
            tar::EntryType::Symlink => {
                let target = entry.link_name_bytes().ok_or_else(|| bad("a symlink without a target"))?.into_owned();
                if target.is_empty() || target.len() >= self.limits.path_bytes || target.contains(&0) {
                    return Err(bad("the symlink's target is empty or too long"));
                }
                self.tree.add(Node { meta, kind: Kind::Symlink(target) })
            }
            tar::EntryType::Link => {
                let target = entry.link_name_bytes().ok_or_else(|| bad("a hard link without a target"))?.into_owned();
                let parts = components(&target).map_err(|r| bad(&format!("its target: {r}")))?;
                let id = self.lookup(&parts).map_err(|r| bad(&format!("its target: {r}")))?;
                if self.tree.entries(id).is_some() {
                    return Err(bad("a hard link to a directory"));
                }
                self.applied.hard_links += 1;
                id
            }
            tar::EntryType::Char | tar::EntryType::Block => {
                let major = header.device_major().ok().flatten().ok_or_else(|| bad("a device without a number"))?;
                let minor = header.device_minor().ok().flatten().ok_or_else(|| bad("a device without a number"))?;
                let kind = match kind {
                    tar::EntryType::Char => Kind::Char { major, minor },
                    _ => Kind::Block { major, minor },
                };
                self.tree.add(Node { meta, kind })
            }
            tar::EntryType::Fifo => self.tree.add(Node { meta, kind: Kind::Fifo }),
            other => return Err(bad(&format!("entries of type {other:?} are not supported"))),
        };
        self.tree.entries_mut(parent).ok_or_else(|| bad("not in a directory"))?.insert(name.clone(), node);
        fresh.insert((parent, name.clone()));
        Ok(())
    }

    /// Mode, owner, mtime and xattrs; PAX records win over the header's fields.
    fn meta(&self, entry: &mut tar::Entry<'_, impl Read>, header: &tar::Header) -> Result<Meta, String> {
        let num = |v: io::Result<u64>, what: &str| v.map_err(|e| format!("its {what}: {e}"));
        let mut uid = num(header.uid(), "uid")?;
        let mut gid = num(header.gid(), "gid")?;
        let mut mtime = num(header.mtime(), "mtime")? as i64;
        let mode = num(header.mode().map(u64::from), "mode")? as u32;
        let mut xattrs = BTreeMap::new();
        if let Some(pax) = entry.pax_extensions().map_err(|e| format!("its PAX records: {e}"))? {
            for ext in pax {
                let ext = ext.map_err(|e| format!("its PAX records: {e}"))?;
                let (key, value) = (ext.key_bytes(), ext.value_bytes());
                let number = || std::str::from_utf8(value).ok().and_then(|v| v.split('.').next()?.parse::<i64>().ok());
                match key {
                    b"uid" => uid = number().ok_or("a PAX uid that is not a number")? as u64,
                    b"gid" => gid = number().ok_or("a PAX gid that is not a number")? as u64,
                    b"mtime" => mtime = number().ok_or("a PAX mtime that is not a number")?,
                    _ => {
                        if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                            if name.is_empty() || name.len() > 255 || value.len() > self.limits.xattr_bytes {
                                return Err("an xattr name or value is too long".into());
                            }
                            xattrs.insert(name.to_vec(), value.to_vec());
                        }
                    }
                }
            }
        }
        let uid = u32::try_from(uid).map_err(|_| format!("uid {uid} does not fit 32 bits"))?;
        let gid = u32::try_from(gid).map_err(|_| format!("gid {gid} does not fit 32 bits"))?;
        Ok(Meta { xattrs, ..Meta::new(mode, uid, gid, mtime) })
    }

    /// The directory `dirs` names, made (0755, root, like the parents a runtime makes) where
    /// missing; symlinks on the way are followed inside the tree.
    fn make_dirs(&mut self, dirs: &[Vec<u8>], header: &tar::Header) -> Result<NodeId, String> {
        let mtime = header.mtime().unwrap_or(0) as i64;
        let mut at = ROOT;
        for (i, part) in dirs.iter().enumerate() {
            let next = match self.tree.entries(at).and_then(|e| e.get(part)).copied() {
                Some(id) => id,
                None => {
                    let id =
                        self.tree.add(Node { meta: Meta::new(0o755, 0, 0, mtime), kind: Kind::Dir(BTreeMap::new()) });
                    self.tree.entries_mut(at).ok_or("a parent is not a directory")?.insert(part.clone(), id);
                    id
                }
            };
            at = match &self.tree.node(next).kind {
                Kind::Dir(_) => next,
                Kind::Symlink(_) => self.resolve(&dirs[..=i], true)?,
                _ => return Err(format!("{} is not a directory", String::from_utf8_lossy(part))),
            };
        }
        Ok(at)
    }

    /// The node `parts` names, every symlink followed within the tree except a last one.
    fn lookup(&self, parts: &[Vec<u8>]) -> Result<NodeId, String> {
        let Some((last, dirs)) = parts.split_last() else { return Ok(ROOT) };
        let dir = self.resolve(dirs, true)?;
        self.tree
            .entries(dir)
            .and_then(|e| e.get(last))
            .copied()
            .ok_or_else(|| format!("{} does not exist", String::from_utf8_lossy(&parts.join(&b'/'))))
    }

    /// Follows `parts` from the root, symlinks included, as the guest's kernel would with this
    /// tree as `/`: `..` stops at the root, absolute targets start from it. `want_dir`: the
    /// result must be a directory.
    pub(crate) fn resolve(&self, parts: &[Vec<u8>], want_dir: bool) -> Result<NodeId, String> {
        resolve(self.tree, parts, want_dir)
    }
}

/// See [`Applier::resolve`].
pub(crate) fn resolve(tree: &Tree, parts: &[Vec<u8>], want_dir: bool) -> Result<NodeId, String> {
    let mut stack: Vec<NodeId> = vec![ROOT];
    let mut todo: Vec<Vec<u8>> = parts.iter().rev().cloned().collect();
    let mut hops = 0;
    while let Some(part) = todo.pop() {
        let here = *stack.last().expect("the root stays");
        match part.as_slice() {
            b"" | b"." => continue,
            b".." => {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            _ => {}
        }
        let shown = || String::from_utf8_lossy(&part).into_owned();
        let id = tree
            .entries(here)
            .and_then(|e| e.get(&part))
            .copied()
            .ok_or_else(|| format!("{} does not exist", shown()))?;
        match &tree.node(id).kind {
            Kind::Dir(_) => stack.push(id),
            Kind::Symlink(target) => {
                hops += 1;
                if hops > MAX_HOPS {
                    return Err(format!("more than {MAX_HOPS} symlinks at {}", shown()));
                }
                if target.starts_with(b"/") {
                    stack.truncate(1);
                }
                todo.extend(target.split(|b| *b == b'/').rev().map(<[u8]>::to_vec));
            }
            _ if todo.is_empty() && !want_dir => return Ok(id),
            _ => return Err(format!("{} is not a directory", shown())),
        }
    }
    Ok(*stack.last().expect("the root stays"))
}

fn check_name(name: &[u8]) -> Result<(), String> {
    if name.is_empty() || name == b"." || name == b".." || name.len() > 255 || name.contains(&0) || name.contains(&b'/')
    {
        return Err(format!("{:?} is not a file name", String::from_utf8_lossy(name)));
    }
    Ok(())
}

/// A layer path's components: leading `/` and `./` and empty or `.` parts dropped; `..`
/// refused (a layer names paths inside the image, and a tar that climbs is hostile).
pub(crate) fn components(path: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut out = Vec::new();
    for part in path.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err("the path climbs out of the image with `..`".into()),
            _ => {
                check_name(part)?;
                out.push(part.to_vec());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar of `(path, kind)`: `f:DATA` a file, `d` a directory, `l:TARGET` a symlink, `h:TARGET`
    /// a hard link.
    fn layer(entries: &[(&str, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_mtime(7);
            h.set_uid(0);
            h.set_gid(0);
            h.set_size(0);
            let (k, arg) = kind.split_once(':').unwrap_or((kind, ""));
            match k {
                "f" => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(arg.len() as u64);
                    b.append_data(&mut h, path, arg.as_bytes()).unwrap();
                }
                "d" => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(0o755);
                    b.append_data(&mut h, path, &[][..]).unwrap();
                }
                "l" | "h" => {
                    h.set_entry_type(if k == "l" { tar::EntryType::Symlink } else { tar::EntryType::Link });
                    b.append_link(&mut h, path, arg).unwrap();
                }
                _ => unreachable!(),
            }
        }
        b.into_inner().unwrap()
    }

    fn apply(layers: &[Vec<u8>]) -> Result<Tree, LayerError> {
        let mut tree = Tree::new(tempfile::tempfile().unwrap());
        let mut applier = Applier::new(&mut tree, Limits::default());
        for (i, l) in layers.iter().enumerate() {
            applier.apply(i, &l[..], None)?;
        }
        Ok(tree)
    }

    /// `path` → its contents (files), `->target` (symlinks), `/` (directories); None if absent.
    fn look(tree: &Tree, path: &str) -> Option<String> {
        let parts = components(path.as_bytes()).unwrap();
        let (last, dirs) = parts.split_last()?;
        let dir = resolve(tree, dirs, true).ok()?;
        let id = *tree.entries(dir)?.get(last)?;
        Some(match &tree.node(id).kind {
            Kind::File(e) => {
                let mut buf = vec![0; e.len as usize];
                tree.read_content(*e, 0, &mut buf).unwrap();
                String::from_utf8(buf).unwrap()
            }
            Kind::Symlink(t) => format!("->{}", String::from_utf8_lossy(t)),
            Kind::Dir(_) => "/".into(),
            _ => "special".into(),
        })
    }

    #[test]
    fn whiteouts_and_opaque_directories_hide_only_lower_layers() {
        let l0 = layer(&[("a/x", "f:1"), ("a/y", "f:2"), ("b/old", "f:3"), ("b/sub/deep", "f:4"), ("keep", "f:5")]);
        let l1 = layer(&[("a/.wh.x", "f:"), ("b/new", "f:6"), ("b/.wh..wh..opq", "f:"), ("c", "f:7")]);
        let tree = apply(&[l0, l1]).unwrap();
        assert_eq!(look(&tree, "a/x"), None);
        assert_eq!(look(&tree, "a/y").as_deref(), Some("2"));
        // The marker came after `b/new`, from the same layer: `new` stays, the lower ones go.
        assert_eq!(look(&tree, "b/new").as_deref(), Some("6"));
        assert_eq!((look(&tree, "b/old"), look(&tree, "b/sub")), (None, None));
        assert_eq!(look(&tree, "keep").as_deref(), Some("5"));
    }

    #[test]
    fn paths_that_climb_are_refused_and_the_rest_normalised() {
        assert_eq!(components(b"./a//b/./c/").unwrap(), [b"a".to_vec(), b"b".to_vec(), b"c".to_vec()]);
        assert_eq!(components(b"/").unwrap(), Vec::<Vec<u8>>::new());
        for bad in [&b"a/../../etc"[..], b"../x", b"a/.."] {
            assert!(components(bad).unwrap_err().contains("climbs"), "{bad:?}");
        }
        assert!(components(&[b'a'; 256]).is_err(), "a name over 255 bytes");
    }

    #[test]
    fn symlinks_resolve_inside_the_image_and_never_climb_out() {
        let l0 =
            layer(&[("etc", "d"), ("root-link", "l:/"), ("up", "l:../../.."), ("lib", "l:usr/lib"), ("usr/lib", "d")]);
        let l1 = layer(&[("root-link/etc/passwd", "f:p"), ("up/escaped", "f:e"), ("lib/libc.so", "f:c")]);
        let tree = apply(&[l0, l1]).unwrap();
        assert_eq!(look(&tree, "etc/passwd").as_deref(), Some("p"));
        assert_eq!(look(&tree, "escaped").as_deref(), Some("e"), "`..` above the root stays at the root");
        assert_eq!(look(&tree, "usr/lib/libc.so").as_deref(), Some("c"));
        assert!(look(&tree, "root-link").unwrap().starts_with("->/"), "the symlink itself is kept");
        // A loop of symlinks ends with an error, not a hang.
        let loops = layer(&[("a", "l:b"), ("b", "l:a"), ("a/file", "f:x")]);
        let e = apply(&[loops]).unwrap_err().to_string();
        assert!(e.contains("more than 40 symlinks"), "{e}");
    }

    #[test]
    fn hard_links_name_one_node_and_a_replaced_file_is_a_new_one() {
        let l0 = layer(&[("a", "f:one"), ("b", "h:a"), ("d", "d")]);
        let l1 = layer(&[("a", "f:two")]);
        let tree = apply(&[l0, l1]).unwrap();
        assert_eq!((look(&tree, "a").as_deref(), look(&tree, "b").as_deref()), (Some("two"), Some("one")));
        for bad in [("x", "h:missing"), ("x", "h:d"), ("x", "h:../etc/passwd")] {
            let e = apply(&[layer(&[("d", "d"), bad])]).unwrap_err().to_string();
            assert!(e.contains("layer 0: x:"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_layer_whose_digest_differs_from_its_diff_id_is_refused() {
        let l0 = layer(&[("a", "f:1")]);
        let right = hex::encode(Sha256::digest(&l0));
        let mut tree = Tree::new(tempfile::tempfile().unwrap());
        let mut applier = Applier::new(&mut tree, Limits::default());
        applier.apply(0, &l0[..], Some(&right)).unwrap();
        let e = applier.apply(1, &l0[..], Some(&"0".repeat(64))).unwrap_err();
        assert!(matches!(e, LayerError::DiffId { layer: 1, .. }), "{e}");
        // gzip and zstd are recognised by their bytes and hash to the same diff_id.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &l0).unwrap();
        applier.apply(2, &gz.finish().unwrap()[..], Some(&right)).unwrap();
        applier.apply(3, &zstd::encode_all(&l0[..], 1).unwrap()[..], Some(&right)).unwrap();
    }

    #[test]
    fn limits_bound_what_a_layer_makes_the_host_keep() {
        let big = layer(&[("a", "f:0123456789"), ("b", "f:0123456789")]);
        let mut tree = Tree::new(tempfile::tempfile().unwrap());
        let limits = Limits { content_bytes: 15, ..Limits::default() };
        let e = Applier::new(&mut tree, limits).apply(0, &big[..], None).unwrap_err();
        assert!(e.to_string().contains("more than 15 bytes of files"), "{e}");
        let limits = Limits { entries: 1, ..Limits::default() };
        let e = Applier::new(&mut tree, limits).apply(0, &big[..], None).unwrap_err();
        assert!(e.to_string().contains("more than 1 entries"), "{e}");
    }
}
