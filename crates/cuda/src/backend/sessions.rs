//! Sessions and their KV on CUDA: a session created where new and its KV grown for what a
//! call writes (KvFull where `kv_pool_bytes` would be passed), and forks that copy the
//! source's positions.

use q4moe_model::backend::SessionId;

use super::CudaBackend;
use crate::session::Session;
use crate::step::Kv;
use crate::{CudaError, Result};

impl CudaBackend {
    pub(super) fn session(&mut self, id: SessionId) -> Result<&mut Session> {
        self.session_holding(id, 0)
    }

    /// Session `id`, created or grown so its KV holds at least `need` positions (callers
    /// check spans against kv_capacity first): a new session's KV is kv_grow_from positions,
    /// doubled until it holds `need`. Growing allocates the larger KV and copies the held
    /// positions into it; a call grows before its work, so no step of the old KV is in flight.
    pub(super) fn session_holding(&mut self, id: SessionId, need: usize) -> Result<&mut Session> {
        self.check_room(id, self.kv_growth(id, need))?;
        self.grow(id, need)
    }

    /// `session_holding` once the pool's room for the growth is checked.
    fn grow(&mut self, id: SessionId, need: usize) -> Result<&mut Session> {
        let (c, o) = (&self.model.config, &self.opts);
        let cap = Kv::capacity_for(need, o.kv_grow_from, o.kv_capacity);
        match self.sessions.get_mut(&id) {
            None => {
                let kv = Kv::new(&self.dev, c, cap)?;
                self.sessions.insert(id, Session::new(kv));
            }
            Some(s) if s.kv.capacity < need => {
                let kv = Kv::new(&self.dev, c, cap)?;
                kv.copy_from(&self.dev, c, &s.kv, s.len)?;
                // The copies are done before the old buffers are freed.
                self.dev.sync()?;
                s.replace_kv(kv);
            }
            Some(_) => {}
        }
        Ok(self.sessions.get_mut(&id).expect("present"))
    }

    /// Every (session, need) at once (distinct sessions), all or nothing: their growth
    /// together checked against `kv_pool_bytes` first (KvFull for the first session, nothing
    /// grown), then each grown.
    pub(super) fn hold_all(&mut self, wants: &[(SessionId, usize)]) -> Result<()> {
        let growth = wants.iter().map(|&(id, n)| self.kv_growth(id, n)).sum();
        if let Some(&(id, _)) = wants.first() {
            self.check_room(id, growth)?;
        }
        for &(id, need) in wants {
            self.grow(id, need)?;
        }
        Ok(())
    }

    /// KvFull (naming `id`) where `growth` more bytes would pass `kv_pool_bytes`.
    fn check_room(&self, id: SessionId, growth: usize) -> Result<()> {
        let (pool, used) = (self.opts.kv_pool_bytes, self.kv_used());
        if growth > 0 && used.saturating_add(growth) > pool {
            return Err(CudaError::KvFull {
                session: id,
                needed: growth,
                free: pool.saturating_sub(used),
                capacity: pool,
            });
        }
        Ok(())
    }

    /// Bytes every session's KV takes.
    pub(super) fn kv_used(&self) -> usize {
        self.sessions.values().map(|s| s.kv.held_bytes()).sum()
    }

    /// Bytes session `id`'s KV grows by to hold `need` positions (a new session's whole KV; a
    /// grown one replaces the old, whose bytes come back): what `kv_pool_bytes` must allow.
    pub(super) fn kv_growth(&self, id: SessionId, need: usize) -> usize {
        let (c, o) = (&self.model.config, &self.opts);
        let bytes = |cap| Kv::bytes(c, cap, o.kv_type);
        let grown = bytes(Kv::capacity_for(need, o.kv_grow_from, o.kv_capacity));
        match self.sessions.get(&id) {
            None => grown,
            Some(s) if s.kv.capacity < need => grown.saturating_sub(s.kv.held_bytes()),
            Some(_) => 0,
        }
    }

    /// `dst` anew with a copy of `src`'s first `len` positions (Kv::copy_from).
    pub(super) fn fork_kv(&mut self, src: SessionId, dst: SessionId, len: usize) -> Result<()> {
        self.dev.bind()?;
        self.sessions.remove(&dst);
        self.session_holding(dst, len)?;
        let c = &self.model.config;
        let (Some(from), Some(to)) = (self.sessions.get(&src), self.sessions.get(&dst)) else {
            return Ok(()); // an unknown src holds nothing: len is 0 (checked)
        };
        to.kv.copy_from(&self.dev, c, &from.kv, len)?;
        self.dev.sync()?;
        self.sessions.get_mut(&dst).expect("created").len = len;
        Ok(())
    }
}
