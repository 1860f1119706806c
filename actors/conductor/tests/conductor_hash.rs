//! Chunk hashing properties.

use kvpool_conductor::chunk_hash::{chunk_hashes, ChunkHash, StoreKey};
use proptest::prelude::*;

proptest! {
    #[test]
    fn hashes_of_a_prefix_are_a_prefix_of_the_hashes(
        tokens in proptest::collection::vec(any::<u32>(), 0..2_000),
        cut in 0usize..2_000,
        chunk in 1usize..300,
    ) {
        let cut = cut.min(tokens.len());
        let all = chunk_hashes(&tokens, chunk).unwrap();
        let head = chunk_hashes(&tokens[..cut], chunk).unwrap();
        prop_assert_eq!(all.len(), tokens.len() / chunk);
        prop_assert_eq!(head.len(), cut / chunk);
        prop_assert_eq!(&all[..head.len()], &head[..]);
    }

    #[test]
    fn changing_one_token_changes_its_chunk_and_every_later_one(
        tokens in proptest::collection::vec(any::<u32>(), 64..1_024),
        pos in 0usize..1_024,
        chunk in 1usize..64,
    ) {
        let pos = pos % tokens.len();
        let mut other = tokens.clone();
        other[pos] = other[pos].wrapping_add(1);
        let a = chunk_hashes(&tokens, chunk).unwrap();
        let b = chunk_hashes(&other, chunk).unwrap();
        let first_changed = pos / chunk;
        for i in 0..a.len() {
            if i < first_changed {
                prop_assert_eq!(a[i], b[i]);
            } else {
                prop_assert_ne!(a[i], b[i]);
            }
        }
    }

    #[test]
    fn store_keys_round_trip(
        model in "[a-zA-Z0-9._-]{1,24}",
        format in "[a-z0-9_-]{1,12}",
        hash in any::<u64>(),
        ntokens in any::<u32>(),
    ) {
        let key = StoreKey::new(&model, ChunkHash(hash), &format, ntokens).unwrap();
        let text = key.to_string();
        prop_assert_eq!(text.matches('@').count(), 3);
        prop_assert_eq!(text.parse::<StoreKey>().unwrap(), key);
    }
}

#[test]
fn same_prefix_same_hashes_across_calls() {
    let a: Vec<u32> = (0..1_024).map(|i| i * 7).collect();
    let mut b = a[..768].to_vec();
    b.extend(5_000..5_500);
    let ha = chunk_hashes(&a, 256).unwrap();
    let hb = chunk_hashes(&b, 256).unwrap();
    assert_eq!(ha[..3], hb[..3]);
    assert_ne!(ha[3], hb[3]);
}
