//! The random k-regular communication graph of SecAgg+ (Bell et al. 2020):
//! a Harary graph over a pseudorandom ordering of the participants. Each
//! device is joined to the k/2 devices on either side of it in the
//! ordering, so every device has exactly k neighbours, and, the ordering
//! being random, a device's neighbourhood is a uniformly random k-subset of
//! the others. When k reaches n − 1 it is the complete graph of the
//! original protocol (Bonawitz et al. 2017).
//!
//! The ordering sorts devices by SHA-256(seed ‖ id), so anyone who knows the
//! seed and the participants computes the same graph, with no dependency
//! on a random-number generator's version.

use std::collections::{BTreeMap, BTreeSet};

use sha2::{Digest, Sha256};

use super::SecAggError;

/// What a round's plan carries in place of its graph seed: the seed is
/// sent only once every device has made its keys, and checked against
/// this.
pub fn commitment(seed: &[u8; 32]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"canopy-secagg-v2 graph seed");
    hasher.update(seed);
    hasher.finalize().into()
}

#[derive(Clone, Debug)]
pub struct Graph {
    order: Vec<u64>,
    position: BTreeMap<u64, usize>,
    degree: usize,
}

impl Graph {
    pub fn new(seed: &[u8; 32], participants: &[u64], degree: usize) -> Result<Graph, SecAggError> {
        let n = participants.len();
        let unique: BTreeSet<u64> = participants.iter().copied().collect();
        if unique.len() != n {
            return Err(SecAggError::invalid(format!(
                "the participant list repeats a device id ({} ids, {} distinct)",
                n,
                unique.len()
            )));
        }
        let complete = n.saturating_sub(1);
        if degree > complete || (degree < complete && degree % 2 == 1) || degree == 0 {
            return Err(SecAggError::invalid(format!(
                "a graph over {n} devices cannot have degree {degree}: it must be even and \
                 below {complete}, or exactly {complete}"
            )));
        }
        let mut keyed: Vec<([u8; 32], u64)> = unique
            .into_iter()
            .map(|id| {
                let mut hasher = Sha256::new();
                hasher.update(seed);
                hasher.update(id.to_le_bytes());
                (hasher.finalize().into(), id)
            })
            .collect();
        keyed.sort_unstable();
        let order: Vec<u64> = keyed.into_iter().map(|(_, id)| id).collect();
        let position = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        Ok(Graph {
            order,
            position,
            degree,
        })
    }

    pub fn degree(&self) -> usize {
        self.degree
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The participants in ascending id order.
    pub fn participants(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.position.keys().copied()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.position.contains_key(&id)
    }

    /// The device's neighbours in ascending id order, or `None` for a
    /// device that is not in the graph.
    pub fn neighbours(&self, id: u64) -> Option<Vec<u64>> {
        let &at = self.position.get(&id)?;
        let n = self.order.len();
        let mut out: Vec<u64> = if self.degree == n - 1 {
            self.order
                .iter()
                .copied()
                .filter(|&other| other != id)
                .collect()
        } else {
            (1..=self.degree / 2)
                .flat_map(|step| [self.order[(at + step) % n], self.order[(at + n - step) % n]])
                .collect()
        };
        out.sort_unstable();
        Some(out)
    }

    pub fn are_neighbours(&self, a: u64, b: u64) -> bool {
        let (Some(&pa), Some(&pb)) = (self.position.get(&a), self.position.get(&b)) else {
            return false;
        };
        if a == b {
            return false;
        }
        let n = self.order.len();
        let distance = pa.abs_diff(pb);
        distance.min(n - distance) <= self.degree / 2 || self.degree == n - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_has_exactly_k_symmetric_neighbours() {
        let ids: Vec<u64> = (100..160).collect();
        let graph = Graph::new(&[3; 32], &ids, 8).unwrap();
        for &id in &ids {
            let neighbours = graph.neighbours(id).unwrap();
            assert_eq!(neighbours.len(), 8);
            for &other in &neighbours {
                assert!(graph.neighbours(other).unwrap().contains(&id));
                assert!(graph.are_neighbours(id, other));
            }
            let strangers = ids.iter().filter(|o| !neighbours.contains(o) && **o != id);
            for &other in strangers {
                assert!(!graph.are_neighbours(id, other));
            }
        }
    }

    #[test]
    fn the_seed_changes_the_graph_and_duplicates_are_refused() {
        let ids: Vec<u64> = (1..=50).collect();
        let a = Graph::new(&[1; 32], &ids, 4).unwrap();
        let b = Graph::new(&[2; 32], &ids, 4).unwrap();
        assert_ne!(a.neighbours(1), b.neighbours(1));
        assert!(Graph::new(&[1; 32], &[1, 2, 2, 3], 2).is_err());
        assert!(Graph::new(&[1; 32], &ids, 5).is_err());
        let complete = Graph::new(&[1; 32], &ids[..6], 5).unwrap();
        assert_eq!(complete.neighbours(1).unwrap(), vec![2, 3, 4, 5, 6]);
    }
}
