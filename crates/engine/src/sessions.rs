//! Which tokens each backend session's KV holds, for prefix reuse across requests, with LRU
//! eviction under a bound on the bytes the cached sessions' KV takes (what the backend says a
//! session costs: the CPU's the pages it holds, a page shared between sessions counted once;
//! a CUDA session its allocation), and, where the backend keeps KV in one pool (the CPU), LRU
//! eviction of cached sessions when a running one needs room (`make_room`).

use std::collections::HashMap;

use q4moe_model::backend::{Backend, SessionId};

struct Entry {
    /// Tokens whose keys and values are in the session's KV, in order.
    tokens: Vec<u32>,
    last_used: u64,
}

pub struct SessionStore {
    entries: HashMap<SessionId, Entry>,
    clock: u64,
    next_id: SessionId,
    max_bytes: usize,
}

pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SessionStore {
    /// A store keeping cached sessions whose KV takes at most `max_bytes` in all (the one
    /// released last is kept whatever its size).
    pub fn new(max_bytes: usize) -> Self {
        SessionStore {
            entries: HashMap::new(),
            clock: 0,
            next_id: 1,
            max_bytes,
        }
    }

    /// Takes the session to run `prompt` in: with `reuse`, the cached one sharing the longest
    /// prefix (at most all but the last prompt token: decode feeds that one to produce the first
    /// generated token), truncated to it; else a new one. Returns the session and how many prompt
    /// tokens its KV already holds.
    ///
    /// A cached conversation is taken over only when the prompt keeps at least as much of it as
    /// the truncation would throw away (a next turn, whose history may render a little
    /// differently from the tokens generated), or shares at least half the prompt (a regenerated
    /// or edited turn). A prompt that shares less (another conversation with the same system
    /// prompt) gets a new session holding that prefix (Backend::fork: the prefix's pages shared
    /// on a paged backend, copied on CUDA), and the conversation it came from stays whole for
    /// its own next turn.
    pub fn acquire(
        &mut self,
        backend: &mut dyn Backend,
        prompt: &[u32],
        reuse: bool,
    ) -> (SessionId, usize) {
        let usable = prompt.len().saturating_sub(1);
        let best = reuse
            .then(|| {
                self.entries
                    .iter()
                    .map(|(&id, e)| {
                        let n = common_prefix(&e.tokens, prompt).min(usable);
                        let lost = e.tokens.len() - n;
                        (id, n, lost <= n || 2 * n >= prompt.len())
                    })
                    .filter(|&(_, n, _)| n > 0)
                    .max_by_key(|&(id, n, take)| (n, take, std::cmp::Reverse(id)))
            })
            .flatten();
        if let Some((id, n, true)) = best {
            self.entries.remove(&id);
            backend.truncate(id, n);
            return (id, n);
        }
        let id = self.next_id;
        self.next_id += 1;
        match best {
            // A failed copy (out of device memory) only costs the prefill it would have saved.
            Some((from, n, _)) if backend.fork(from, id, n).is_ok() => {
                self.touch(from);
                (id, n)
            }
            _ => (id, 0),
        }
    }

    /// Marks a cached session as just used (what the LRU eviction orders by).
    fn touch(&mut self, id: SessionId) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&id) {
            e.last_used = self.clock;
        }
    }

    /// Returns a session after use, recording what its KV holds; evicts least recently used
    /// sessions while the cached ones' KV takes more than the bound.
    pub fn release(&mut self, backend: &mut dyn Backend, session: SessionId, tokens: Vec<u32>) {
        self.clock += 1;
        self.entries.insert(
            session,
            Entry {
                tokens,
                last_used: self.clock,
            },
        );
        loop {
            if self.bytes(backend) <= self.max_bytes || self.entries.len() <= 1 {
                break;
            }
            let oldest = self.entries.iter().min_by_key(|(_, e)| e.last_used);
            let Some((&oldest, _)) = oldest else { break };
            self.entries.remove(&oldest);
            backend.drop_session(oldest);
        }
    }

    /// Bytes the cached sessions' KV takes (a page they share counted once).
    pub fn bytes(&self, backend: &dyn Backend) -> usize {
        let ids: Vec<SessionId> = self.entries.keys().copied().collect();
        backend.kv_bytes_of(&ids)
    }

    /// Where the backend keeps KV in one pool: drops cached sessions, least recently used
    /// first, until the pool has room for `needs` (each running session and the positions it is
    /// about to add), or none is left. Returns whether the room is there (always, without a
    /// pool). A cached session whose pages a running one shares frees only what is its own.
    pub fn make_room(&mut self, backend: &mut dyn Backend, needs: &[(SessionId, usize)]) -> bool {
        loop {
            let Some(pool) = backend.kv_pool() else {
                return true;
            };
            let needed: usize = needs.iter().map(|&(s, n)| backend.kv_needed(s, n)).sum();
            if needed <= pool.free_bytes() {
                return true;
            }
            let oldest = self.entries.iter().min_by_key(|(_, e)| e.last_used);
            let Some((&oldest, _)) = oldest else {
                return false;
            };
            self.entries.remove(&oldest);
            backend.drop_session(oldest);
        }
    }

    /// Drops a session that failed mid-way (its KV is in an unknown state).
    pub fn discard(&mut self, backend: &mut dyn Backend, session: SessionId) {
        self.entries.remove(&session);
        backend.drop_session(session);
    }

    pub fn clear(&mut self, backend: &mut dyn Backend) {
        for (id, _) in self.entries.drain() {
            backend.drop_session(id);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
