//! The vsock packet (virtio 1.2 §5.10.6): a 44-byte header and, for OP_RW, up to 64 KiB of data,
//! carried in one descriptor chain — device-readable on the tx queue, device-writable on rx.
//!
//! This is the one place that looks at guest buffers. A chain is walked once: every descriptor
//! must have the direction its queue requires and lie inside guest memory, and there are at most
//! [`MAX_CHAIN_DESCRIPTORS`] of them. The header is then *copied out* before any field is read:
//! the guest can rewrite its buffers at any moment, and a private copy is the only version worth
//! validating. The header may be split across descriptors at any byte, as may the data. Nothing
//! here allocates in proportion to a guest-chosen length: data is copied by the caller into a
//! scratch buffer of at most [`MAX_PKT_DATA`] bytes.

use std::fmt;

use virtio_queue::desc::split::Descriptor;
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, Le16, Le32, Le64};

/// Size of `struct virtio_vsock_hdr`.
pub const HDR_SIZE: usize = 44;
/// Largest data payload accepted from or given to the guest (Linux's VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
pub const MAX_PKT_DATA: usize = 64 * 1024;
/// A chain longer than this is not a vsock buffer (Linux uses 1 or 2 descriptors, at most
/// MAX_SKB_FRAGS + 1 = 18 for a fragmented tx packet); the bound also caps what one chain can
/// cost, indirect tables and descriptor loops included.
pub const MAX_CHAIN_DESCRIPTORS: usize = 64;

/// The host's well-known CID (VMADDR_CID_HOST).
pub const HOST_CID: u64 = 2;
/// VIRTIO_VSOCK_TYPE_STREAM; the only socket type this device offers.
pub const TYPE_STREAM: u16 = 1;

/// Packet operations (VIRTIO_VSOCK_OP_*).
pub mod op {
    pub const REQUEST: u16 = 1;
    pub const RESPONSE: u16 = 2;
    pub const RST: u16 = 3;
    pub const SHUTDOWN: u16 = 4;
    pub const RW: u16 = 5;
    pub const CREDIT_UPDATE: u16 = 6;
    pub const CREDIT_REQUEST: u16 = 7;

    /// Whether `op` is one this device understands.
    pub fn is_known(op: u16) -> bool {
        (REQUEST..=CREDIT_REQUEST).contains(&op)
    }
}

/// OP_SHUTDOWN flags.
pub mod shutdown {
    /// The sender will receive no more data.
    pub const RCV: u32 = 1;
    /// The sender will send no more data.
    pub const SEND: u32 = 2;
    pub const BOTH: u32 = RCV | SEND;
}

/// The packet header, exactly as it sits in guest memory:
///
/// ```c
/// struct virtio_vsock_hdr {
///     le64 src_cid;
///     le64 dst_cid;
///     le32 src_port;
///     le32 dst_port;
///     le32 len;
///     le16 type;
///     le16 op;
///     le32 flags;
///     le32 buf_alloc;
///     le32 fwd_cnt;
/// } __attribute__((packed));
/// ```
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
pub struct VsockPacketHeader {
    src_cid: Le64,
    dst_cid: Le64,
    src_port: Le32,
    dst_port: Le32,
    len: Le32,
    type_: Le16,
    op: Le16,
    flags: Le32,
    buf_alloc: Le32,
    fwd_cnt: Le32,
}

const _: () = assert!(std::mem::size_of::<VsockPacketHeader>() == HDR_SIZE);

// SAFETY: the struct is `repr(C, packed)` over little-endian integer wrappers: it has no padding
// and every byte pattern is a valid value, which is what `ByteValued` requires.
unsafe impl ByteValued for VsockPacketHeader {}

macro_rules! header_field {
    ($get:ident, $set:ident, $field:ident, $ty:ty, $le:ident) => {
        pub fn $get(&self) -> $ty {
            // A by-value copy: no reference into the packed struct is taken.
            let v = self.$field;
            <$ty>::from(v)
        }
        pub fn $set(&mut self, value: $ty) -> &mut Self {
            self.$field = $le::from(value);
            self
        }
    };
}

// `len` is the spec's name for the data length, not a container's size.
#[allow(clippy::len_without_is_empty)]
impl VsockPacketHeader {
    header_field!(src_cid, set_src_cid, src_cid, u64, Le64);
    header_field!(dst_cid, set_dst_cid, dst_cid, u64, Le64);
    header_field!(src_port, set_src_port, src_port, u32, Le32);
    header_field!(dst_port, set_dst_port, dst_port, u32, Le32);
    header_field!(len, set_len, len, u32, Le32);
    header_field!(type_, set_type, type_, u16, Le16);
    header_field!(op, set_op, op, u16, Le16);
    header_field!(flags, set_flags, flags, u32, Le32);
    header_field!(buf_alloc, set_buf_alloc, buf_alloc, u32, Le32);
    header_field!(fwd_cnt, set_fwd_cnt, fwd_cnt, u32, Le32);

    /// A stream header from the host (`local_port`) to the guest (`guest_cid`:`peer_port`).
    pub fn host_to_guest(guest_cid: u64, local_port: u32, peer_port: u32, op: u16) -> Self {
        let mut hdr = Self::default();
        hdr.set_src_cid(HOST_CID)
            .set_dst_cid(guest_cid)
            .set_src_port(local_port)
            .set_dst_port(peer_port)
            .set_type(TYPE_STREAM)
            .set_op(op);
        hdr
    }
}

impl fmt::Debug for VsockPacketHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VsockPacketHeader")
            .field("src", &format_args!("{}:{}", self.src_cid(), self.src_port()))
            .field("dst", &format_args!("{}:{}", self.dst_cid(), self.dst_port()))
            .field("len", &self.len())
            .field("type", &self.type_())
            .field("op", &self.op())
            .field("flags", &self.flags())
            .field("buf_alloc", &self.buf_alloc())
            .field("fwd_cnt", &self.fwd_cnt())
            .finish()
    }
}

/// Why a descriptor chain is not a usable vsock buffer. The chain is then returned to the guest
/// unused (used length 0) and the device carries on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PacketError {
    #[error("descriptor {index} is device-{found} in a queue whose buffers must be device-{want}")]
    WrongDirection { index: usize, found: &'static str, want: &'static str },
    #[error("descriptor chain has more than {MAX_CHAIN_DESCRIPTORS} descriptors")]
    TooManyDescriptors,
    #[error("descriptor {index} ({len} bytes at {addr:#x}) is outside guest memory")]
    OutOfGuestMemory { index: usize, addr: u64, len: u32 },
    #[error("buffer of {0} bytes cannot hold the {HDR_SIZE}-byte header")]
    ShortHeader(usize),
    #[error("header says {declared} data bytes, over the {MAX_PKT_DATA}-byte limit")]
    DataTooLong { declared: u32 },
    #[error("header says {declared} data bytes, the chain carries {present}")]
    DataPastChain { declared: u32, present: usize },
    #[error("guest memory access failed: {0}")]
    Memory(String),
}

/// Which way a queue's buffers go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The driver wrote them, the device reads them (tx).
    DeviceReadable,
    /// The device fills them (rx).
    DeviceWritable,
}

impl Direction {
    fn name(self) -> &'static str {
        match self {
            Direction::DeviceReadable => "readable",
            Direction::DeviceWritable => "writable",
        }
    }
}

/// The guest memory a descriptor chain describes, as checked (address, length) segments.
#[derive(Debug)]
pub struct ChainBuffer {
    segments: Vec<(GuestAddress, usize)>,
    len: usize,
}

impl ChainBuffer {
    /// Walks a chain (virtio-queue bounds it by the queue size, so loops end) and checks every
    /// descriptor before anything is read or written.
    pub fn from_descriptors(
        mem: &GuestMemoryMmap,
        descriptors: impl Iterator<Item = Descriptor>,
        direction: Direction,
    ) -> Result<Self, PacketError> {
        let mut segments = Vec::new();
        let mut len = 0usize;
        for (index, desc) in descriptors.enumerate() {
            if index == MAX_CHAIN_DESCRIPTORS {
                return Err(PacketError::TooManyDescriptors);
            }
            let writable = desc.is_write_only();
            if writable != (direction == Direction::DeviceWritable) {
                let found = if writable { "writable" } else { "readable" };
                return Err(PacketError::WrongDirection { index, found, want: direction.name() });
            }
            let desc_len = desc.len() as usize;
            if desc_len == 0 {
                continue;
            }
            if !mem.check_range(desc.addr(), desc_len) {
                return Err(PacketError::OutOfGuestMemory { index, addr: desc.addr().0, len: desc.len() });
            }
            // Each segment is inside guest memory, so the sum fits a usize; saturate anyway.
            len = len.saturating_add(desc_len);
            segments.push((desc.addr(), desc_len));
        }
        Ok(ChainBuffer { segments, len })
    }

    /// Total bytes the chain describes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `buf.len()` bytes starting `offset` bytes into the chain.
    pub fn read_at(&self, mem: &GuestMemoryMmap, offset: usize, buf: &mut [u8]) -> Result<(), PacketError> {
        self.for_each_piece(offset, buf.len(), |addr, at, n| {
            mem.read_slice(&mut buf[at..at + n], addr).map_err(|e| PacketError::Memory(e.to_string()))
        })
    }

    /// Copies `data` into the chain starting `offset` bytes in.
    pub fn write_at(&self, mem: &GuestMemoryMmap, offset: usize, data: &[u8]) -> Result<(), PacketError> {
        self.for_each_piece(offset, data.len(), |addr, at, n| {
            mem.write_slice(&data[at..at + n], addr).map_err(|e| PacketError::Memory(e.to_string()))
        })
    }

    /// Calls `f(guest address, offset into the caller's buffer, length)` for each piece of the
    /// range `[offset, offset + count)` of the chain.
    fn for_each_piece(
        &self,
        offset: usize,
        count: usize,
        mut f: impl FnMut(GuestAddress, usize, usize) -> Result<(), PacketError>,
    ) -> Result<(), PacketError> {
        let end = offset.checked_add(count).filter(|&e| e <= self.len);
        if end.is_none() {
            return Err(PacketError::Memory(format!(
                "{count} bytes at offset {offset} overrun a {}-byte chain",
                self.len
            )));
        }
        let mut skip = offset;
        let mut done = 0usize;
        for &(addr, seg_len) in &self.segments {
            if done == count {
                break;
            }
            if skip >= seg_len {
                skip -= seg_len;
                continue;
            }
            let n = (seg_len - skip).min(count - done);
            // `skip < seg_len` and the segment was range-checked, so this cannot overflow.
            f(GuestAddress(addr.0 + skip as u64), done, n)?;
            done += n;
            skip = 0;
        }
        Ok(())
    }
}

/// A packet the guest put on the tx queue: a validated header copy and a view of its data.
#[derive(Debug)]
pub struct TxPacket {
    pub hdr: VsockPacketHeader,
    buffer: ChainBuffer,
}

impl TxPacket {
    /// Checks the chain and the header's length field against it.
    pub fn parse(mem: &GuestMemoryMmap, descriptors: impl Iterator<Item = Descriptor>) -> Result<Self, PacketError> {
        let buffer = ChainBuffer::from_descriptors(mem, descriptors, Direction::DeviceReadable)?;
        if buffer.len() < HDR_SIZE {
            return Err(PacketError::ShortHeader(buffer.len()));
        }
        let mut hdr = VsockPacketHeader::default();
        buffer.read_at(mem, 0, hdr.as_mut_slice())?;
        let declared = hdr.len();
        if declared as usize > MAX_PKT_DATA {
            return Err(PacketError::DataTooLong { declared });
        }
        let present = buffer.len() - HDR_SIZE;
        if declared as usize > present {
            return Err(PacketError::DataPastChain { declared, present });
        }
        Ok(TxPacket { hdr, buffer })
    }

    /// Copies the packet's `hdr.len()` data bytes into `scratch` and returns them.
    pub fn read_data<'s>(&self, mem: &GuestMemoryMmap, scratch: &'s mut [u8]) -> Result<&'s [u8], PacketError> {
        let len = self.hdr.len() as usize;
        let dst = scratch
            .get_mut(..len)
            .ok_or_else(|| PacketError::Memory(format!("{len} data bytes exceed the scratch buffer")))?;
        self.buffer.read_at(mem, HDR_SIZE, dst)?;
        Ok(dst)
    }
}

/// A buffer the guest put on the rx queue for the device to fill with one packet.
#[derive(Debug)]
pub struct RxBuffer {
    buffer: ChainBuffer,
}

impl RxBuffer {
    pub fn parse(mem: &GuestMemoryMmap, descriptors: impl Iterator<Item = Descriptor>) -> Result<Self, PacketError> {
        let buffer = ChainBuffer::from_descriptors(mem, descriptors, Direction::DeviceWritable)?;
        if buffer.len() < HDR_SIZE {
            return Err(PacketError::ShortHeader(buffer.len()));
        }
        Ok(RxBuffer { buffer })
    }

    /// How many data bytes a packet in this buffer can carry.
    pub fn data_capacity(&self) -> usize {
        (self.buffer.len() - HDR_SIZE).min(MAX_PKT_DATA)
    }

    /// Writes one packet; `hdr.len` is set from `data`. Returns the used length to report.
    pub fn write_packet(
        &self,
        mem: &GuestMemoryMmap,
        hdr: &mut VsockPacketHeader,
        data: &[u8],
    ) -> Result<u32, PacketError> {
        if data.len() > self.data_capacity() {
            return Err(PacketError::DataTooLong { declared: data.len() as u32 });
        }
        // data.len() <= MAX_PKT_DATA, so these conversions are exact.
        hdr.set_len(data.len() as u32);
        self.buffer.write_at(mem, HDR_SIZE, data)?;
        self.buffer.write_at(mem, 0, hdr.as_slice())?;
        Ok((HDR_SIZE + data.len()) as u32)
    }
}
