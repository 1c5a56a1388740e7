//! Parsing one virtio-blk request (virtio 1.2 §5.2.6) out of a descriptor chain the guest built.
//!
//! The guest controls every field: descriptor addresses, lengths, flags, the order of readable
//! and writable buffers, the header bytes. This module is the one place that turns those into a
//! [`Request`] whose segments are all inside guest memory, in the direction the request needs,
//! with a sector-aligned, bounded length — or into a [`RequestError`] saying which rule was
//! broken. The disk code after it never re-checks.
//!
//! The spec describes a request as a byte layout, not as descriptors: a 16-byte device-readable
//! header, data, and a device-writable status byte at the very end, split over descriptors as
//! the driver likes. So this parser treats the readable descriptors as one byte stream (header,
//! then write data) and the writable ones as another (read data, then the status byte). Linux
//! uses one descriptor each for header and status; a split header is just as valid.
//!
//! ```text
//! struct virtio_blk_req {
//!     le32 type;        // VIRTIO_BLK_T_*
//!     le32 reserved;
//!     le64 sector;      // in 512-byte units, whatever the block size
//!     u8 data[];
//!     u8 status;        // VIRTIO_BLK_S_*
//! };
//! ```

use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemory as _, Permissions};

use crate::vstate::memory::GuestMemory;

/// Bytes per sector: the unit of `sector` and of data lengths, whatever the block size.
pub const SECTOR_SIZE: u64 = 512;
/// Data segments per request offered to the driver (VIRTIO_BLK_F_SEG_MAX).
pub const SEG_MAX: u32 = 128;
/// Bytes per data segment offered to the driver (VIRTIO_BLK_F_SIZE_MAX).
pub const SIZE_MAX: u32 = 64 << 10;
/// The most data one request may carry: what a driver honouring SEG_MAX and SIZE_MAX can send
/// (8 MiB). Bounds the time one request holds the worker.
pub const MAX_DATA_LEN: u64 = SEG_MAX as u64 * SIZE_MAX as u64;
/// The most descriptors one request may span: SEG_MAX data segments plus header and status,
/// with room for a driver that splits those. Longer chains (only possible through indirect
/// tables, or a loop) are refused without a status.
pub const MAX_DESCRIPTORS: usize = 256;

/// The request header, as the guest lays it out.
///
/// ```text
/// le32 type; le32 reserved; le64 sector;
/// ```
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestHeader {
    pub request_type: u32,
    pub reserved: u32,
    pub sector: u64,
}

// SAFETY: RequestHeader is plain old data: integer fields only, no padding (4 + 4 + 8 bytes,
// 8-aligned), and any bit pattern is a valid value.
unsafe impl ByteValued for RequestHeader {}

const HEADER_LEN: usize = std::mem::size_of::<RequestHeader>();

/// A contiguous range of guest memory, checked to lie inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// Read sectors into the guest.
    In,
    /// Write sectors from the guest.
    Out,
    Flush,
    /// Read the device's serial (at most 20 bytes).
    GetId,
    /// A request type this device does not implement; answered with S_UNSUPP.
    Unsupported(u32),
}

/// A request whose buffers have been checked against guest memory and the request's rules.
#[derive(Debug)]
pub struct Request {
    pub kind: RequestKind,
    pub sector: u64,
    /// The data buffers, in order: device-writable for `In` and `GetId`, device-readable for
    /// `Out`, empty for `Flush`. Zero-length descriptors are dropped.
    pub data: Vec<Segment>,
    /// Sum of the data segments' lengths.
    pub data_len: u64,
}

/// Why a request is refused. The guest gets S_IOERR; the message is for logs and tests.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the request header needs {HEADER_LEN} device-readable bytes, the chain has {0}")]
    HeaderTooShort(u64),
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    #[error("a {0:?} request has data buffers in the wrong direction")]
    WrongDirection(RequestKind),
    #[error("data length {0} is not a multiple of {SECTOR_SIZE}")]
    UnalignedLength(u64),
    #[error("data length {0} exceeds the per-request limit of {MAX_DATA_LEN}")]
    TooLarge(u64),
    #[error("buffer of {len} bytes at {addr:#x} is not inside guest memory")]
    OutsideMemory { addr: u64, len: u32 },
    #[error("sectors {sector}+{sectors} are past the capacity of {capacity} sectors")]
    OutOfRange { sector: u64, sectors: u64, capacity: u64 },
    #[error("write to a read-only device")]
    ReadOnly,
    #[error("I/O error on the image: {0}")]
    Io(String),
}

/// Where the status byte goes: the last byte of the last descriptor, if that descriptor is
/// device-writable, non-empty and inside guest memory. Without one the device cannot answer,
/// and the chain is returned with nothing written.
pub fn status_address(mem: &GuestMemory, descriptors: &[Descriptor]) -> Option<GuestAddress> {
    let last = descriptors.last()?;
    if !last.is_write_only() || last.len() == 0 {
        return None;
    }
    let addr = last.addr().0.checked_add(u64::from(last.len()) - 1).map(GuestAddress)?;
    mem.check_range(addr, 1, Permissions::Write).then_some(addr)
}

/// Parses a chain whose status byte has been found by [`status_address`].
pub fn parse(mem: &GuestMemory, descriptors: &[Descriptor]) -> Result<Request, RequestError> {
    // Device-readable buffers come first, then device-writable ones (§2.7.4.2).
    let first_writable = descriptors.iter().position(|d| d.is_write_only()).unwrap_or(descriptors.len());
    let (readable, writable) = descriptors.split_at(first_writable);
    if writable.iter().any(|d| !d.is_write_only()) {
        return Err(RequestError::ReadableAfterWritable);
    }
    let mut readable = checked_segments(mem, readable, Permissions::Read)?;
    let mut writable = checked_segments(mem, writable, Permissions::Write)?;

    let header = read_header(mem, &mut readable)?;
    // The status byte is the last writable byte; what precedes it is read data.
    drop_last_byte(&mut writable);

    let kind = match header.request_type {
        VIRTIO_BLK_T_IN => RequestKind::In,
        VIRTIO_BLK_T_OUT => RequestKind::Out,
        VIRTIO_BLK_T_FLUSH => RequestKind::Flush,
        VIRTIO_BLK_T_GET_ID => RequestKind::GetId,
        other => RequestKind::Unsupported(other),
    };
    let data = match kind {
        RequestKind::In | RequestKind::GetId if readable.is_empty() => writable,
        RequestKind::Out if writable.is_empty() => readable,
        RequestKind::Flush if readable.is_empty() && writable.is_empty() => Vec::new(),
        RequestKind::Unsupported(_) => Vec::new(),
        _ => return Err(RequestError::WrongDirection(kind)),
    };
    let data_len: u64 = data.iter().map(|s| u64::from(s.len)).sum();
    if matches!(kind, RequestKind::In | RequestKind::Out) {
        if data_len % SECTOR_SIZE != 0 {
            return Err(RequestError::UnalignedLength(data_len));
        }
        if data_len > MAX_DATA_LEN {
            return Err(RequestError::TooLarge(data_len));
        }
    }
    Ok(Request { kind, sector: header.sector, data, data_len })
}

/// The descriptors' buffers as segments, each checked to lie inside guest memory. At most
/// [`MAX_DESCRIPTORS`] of them, each under 4 GiB, so the sums below cannot overflow a u64.
fn checked_segments(
    mem: &GuestMemory,
    descriptors: &[Descriptor],
    access: Permissions,
) -> Result<Vec<Segment>, RequestError> {
    let mut segments = Vec::with_capacity(descriptors.len());
    for d in descriptors.iter().filter(|d| d.len() > 0) {
        if !mem.check_range(d.addr(), d.len() as usize, access) {
            return Err(RequestError::OutsideMemory { addr: d.addr().0, len: d.len() });
        }
        segments.push(Segment { addr: d.addr(), len: d.len() });
    }
    Ok(segments)
}

/// Reads the header from the front of the readable stream and removes those bytes from it.
fn read_header(mem: &GuestMemory, readable: &mut Vec<Segment>) -> Result<RequestHeader, RequestError> {
    let mut bytes = [0u8; HEADER_LEN];
    let mut filled = 0;
    let mut consumed_segments = 0;
    for segment in readable.iter_mut() {
        let take = (HEADER_LEN - filled).min(segment.len as usize);
        mem.read_slice(&mut bytes[filled..filled + take], segment.addr)
            .map_err(|_| RequestError::OutsideMemory { addr: segment.addr.0, len: segment.len })?;
        filled += take;
        if take == segment.len as usize {
            consumed_segments += 1;
        } else {
            // `take` is less than the segment's length, which fits in u32; the address was
            // checked to be in memory for the whole length, so this cannot overflow.
            segment.addr = GuestAddress(segment.addr.0 + take as u64);
            segment.len -= take as u32;
        }
        if filled == HEADER_LEN {
            break;
        }
    }
    if filled < HEADER_LEN {
        return Err(RequestError::HeaderTooShort(filled as u64));
    }
    readable.drain(..consumed_segments);
    let mut header = RequestHeader::default();
    header.as_mut_slice().copy_from_slice(&bytes);
    // The guest's fields are little-endian.
    header.request_type = u32::from_le(header.request_type);
    header.sector = u64::from_le(header.sector);
    Ok(header)
}

/// Removes the status byte (the last byte of the writable stream, which [`status_address`]
/// guarantees exists) from the segments.
fn drop_last_byte(writable: &mut Vec<Segment>) {
    if let Some(last) = writable.last_mut() {
        last.len -= 1;
        if last.len == 0 {
            writable.pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::GuestMemoryMmap;

    const W: u16 = VRING_DESC_F_WRITE as u16;

    fn mem() -> GuestMemory {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn header(mem: &GuestMemory, addr: u64, request_type: u32, sector: u64) {
        let h = RequestHeader { request_type: request_type.to_le(), reserved: 0, sector: sector.to_le() };
        mem.write_obj(h, GuestAddress(addr)).unwrap();
    }

    fn d(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    #[test]
    fn header_and_data_may_share_descriptors() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_OUT, 7);
        // Header and the first 512 data bytes in one descriptor, the rest in another.
        let chain = [d(0x1000, 16 + 512, 0), d(0x4000, 512, 0), d(0x8000, 1, W)];
        assert_eq!(status_address(&m, &chain), Some(GuestAddress(0x8000)));
        let r = parse(&m, &chain).unwrap();
        assert_eq!(r.kind, RequestKind::Out);
        assert_eq!(r.sector, 7);
        assert_eq!(
            r.data,
            vec![Segment { addr: GuestAddress(0x1010), len: 512 }, Segment { addr: GuestAddress(0x4000), len: 512 }]
        );
        assert_eq!(r.data_len, 1024);
    }

    #[test]
    fn read_data_and_status_may_share_the_last_descriptor() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let chain = [d(0x1000, 16, 0), d(0x4000, 513, W)];
        assert_eq!(status_address(&m, &chain), Some(GuestAddress(0x4200)));
        let r = parse(&m, &chain).unwrap();
        assert_eq!(r.data, vec![Segment { addr: GuestAddress(0x4000), len: 512 }]);
    }

    #[test]
    fn no_status_byte_without_a_writable_nonempty_last_descriptor_in_memory() {
        let m = mem();
        assert_eq!(status_address(&m, &[]), None);
        assert_eq!(status_address(&m, &[d(0x1000, 16, 0)]), None);
        assert_eq!(status_address(&m, &[d(0x1000, 16, 0), d(0x2000, 0, W)]), None);
        assert_eq!(status_address(&m, &[d(0x1000, 16, 0), d(0x10_0000, 1, W)]), None);
        assert_eq!(status_address(&m, &[d(0x1000, 16, 0), d(u64::MAX, 2, W)]), None);
    }

    #[test]
    fn rule_violations_are_named() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let status = d(0x8000, 1, W);
        let cases: Vec<(Vec<Descriptor>, RequestError)> = vec![
            (vec![d(0x1000, 8, 0), status], RequestError::HeaderTooShort(8)),
            (vec![d(0x1000, 16, 0), d(0x4000, 512, W), d(0x5000, 512, 0), status], RequestError::ReadableAfterWritable),
            (vec![d(0x1000, 16, 0), d(0x4000, 512, 0), status], RequestError::WrongDirection(RequestKind::In)),
            (vec![d(0x1000, 16, 0), d(0x4000, 100, W), status], RequestError::UnalignedLength(100)),
            (
                vec![d(0x1000, 16, 0), d(0xff000, 0x2000, W), status],
                RequestError::OutsideMemory { addr: 0xff000, len: 0x2000 },
            ),
        ];
        for (chain, want) in cases {
            assert_eq!(parse(&m, &chain).unwrap_err(), want, "{chain:?}");
        }
        header(&m, 0x1000, VIRTIO_BLK_T_OUT, 0);
        let err = parse(&m, &[d(0x1000, 16, 0), d(0x4000, 512, W), status]).unwrap_err();
        assert_eq!(err, RequestError::WrongDirection(RequestKind::Out));
        header(&m, 0x1000, VIRTIO_BLK_T_FLUSH, 0);
        let err = parse(&m, &[d(0x1000, 16, 0), d(0x4000, 512, 0), status]).unwrap_err();
        assert_eq!(err, RequestError::WrongDirection(RequestKind::Flush));
    }

    #[test]
    fn data_beyond_the_limit_is_refused() {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), (MAX_DATA_LEN + 0x20_0000) as usize)]).unwrap();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let chain = [d(0x1000, 16, 0), d(0x10_0000, (MAX_DATA_LEN + 512) as u32, W), d(0x8000, 1, W)];
        assert_eq!(parse(&m, &chain).unwrap_err(), RequestError::TooLarge(MAX_DATA_LEN + 512));
    }

    #[test]
    fn unknown_types_parse_without_data_rules() {
        let m = mem();
        header(&m, 0x1000, 0x55, 0);
        let r = parse(&m, &[d(0x1000, 16, 0), d(0x4000, 3, 0), d(0x8000, 1, W)]).unwrap();
        assert_eq!(r.kind, RequestKind::Unsupported(0x55));
        assert!(r.data.is_empty());
    }
}
