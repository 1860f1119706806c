//! A key as the slab keeps it: one pointer to one allocation holding the
//! key's length (two bytes) and its bytes.
//!
//! `Box<[u8]>` is a pointer and a length, 16 bytes in every slab slot; this
//! is 8, and its allocation two bytes longer, which the allocator's rounding
//! mostly absorbs (a 14-byte key takes a 32-byte chunk either way). The
//! master holds tens of millions of keys: the eight bytes pay for an
//! object's version.

use std::alloc::Layout;
use std::ptr::NonNull;

use kvpool_wire::limits::MAX_KEY_BYTES;

/// Keys are at most [`MAX_KEY_BYTES`] long: their length fits two bytes.
const _: () = assert!(MAX_KEY_BYTES <= u16::MAX as usize);

/// Bytes before the key's own: its length.
const LEN_BYTES: usize = 2;

/// An owned key (see the module doc). Dereferences to its bytes.
pub(crate) struct Key(NonNull<u8>);

// SAFETY: a `Key` owns its allocation alone, as a `Box<[u8]>` does, and
// gives out only shared references to it; nothing in it is tied to a thread.
unsafe impl Send for Key {}
// SAFETY: as for `Send`: `&Key` reads the bytes and never writes them.
unsafe impl Sync for Key {}

impl Key {
    /// A copy of `bytes`. Panics over [`MAX_KEY_BYTES`] (the wire refuses
    /// longer keys before any reach the state).
    pub fn new(bytes: &[u8]) -> Self {
        assert!(
            bytes.len() <= MAX_KEY_BYTES,
            "a key of {} bytes is over the limit",
            bytes.len()
        );
        let len = bytes.len() as u16;
        let layout = layout(bytes.len());
        // SAFETY: the layout's size is at least LEN_BYTES, never zero.
        let p = unsafe { std::alloc::alloc(layout) };
        let Some(p) = NonNull::new(p) else {
            std::alloc::handle_alloc_error(layout)
        };
        // SAFETY: `p` is a fresh allocation of LEN_BYTES + bytes.len()
        // bytes, alignment 1: the length goes in its first two bytes and
        // the key after them; `bytes` is another allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(len.to_ne_bytes().as_ptr(), p.as_ptr(), LEN_BYTES);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.as_ptr().add(LEN_BYTES), bytes.len());
        }
        Self(p)
    }

    fn len(&self) -> usize {
        let mut len = [0u8; LEN_BYTES];
        // SAFETY: the allocation starts with the length, written by `new`,
        // and lives as long as `self`.
        unsafe { std::ptr::copy_nonoverlapping(self.0.as_ptr(), len.as_mut_ptr(), LEN_BYTES) };
        u16::from_ne_bytes(len) as usize
    }
}

fn layout(len: usize) -> Layout {
    Layout::from_size_align(LEN_BYTES + len, 1).expect("a key's layout")
}

impl std::ops::Deref for Key {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `new` wrote `len()` initialized bytes after the length,
        // the allocation lives as long as `self`, and nothing writes it.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().add(LEN_BYTES), self.len()) }
    }
}

impl Drop for Key {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` with this same layout (the length has
        // not changed), and freed only here.
        unsafe { std::alloc::dealloc(self.0.as_ptr(), layout(self.len())) }
    }
}

impl Clone for Key {
    fn clone(&self) -> Self {
        Self::new(self)
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&kvpool_wire::proto::show_key(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_holds_its_bytes_in_one_pointer() {
        assert_eq!(std::mem::size_of::<Key>(), 8);
        assert_eq!(std::mem::size_of::<Option<Key>>(), 8);
        for len in [0, 1, 14, 255, 256, 1000, MAX_KEY_BYTES] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let k = Key::new(&bytes);
            assert_eq!(&*k, &bytes[..]);
            let c = k.clone();
            drop(k);
            assert_eq!(&*c, &bytes[..], "a clone owns its own bytes");
        }
    }

    #[test]
    #[should_panic(expected = "over the limit")]
    fn a_key_over_the_wire_limit_is_refused() {
        Key::new(&vec![0; MAX_KEY_BYTES + 1]);
    }
}
