//! The batched decode step (`Backend::step_batch`): one token of each of B sessions through
//! every layer together (batch.rs), each weight row read once for all B, then the output head
//! for all B. Each token attends over its own session's cache at its own position; its logits
//! are bit-identical to running it alone (batch.rs says why).

use q4moe_model::backend::{check_batch, choose_tokens, BackendResult, BatchOut, BatchRow};

use crate::batch::Seats;
use crate::kv::KvCache;
use crate::CpuBackend;

impl CpuBackend {
    pub(crate) fn run_batch(
        &mut self,
        rows: &mut [BatchRow<'_>],
        out: &mut BatchOut,
    ) -> BackendResult<()> {
        let c = &self.model.config;
        check_batch(c, rows, self.kv_capacity, |s| {
            self.sessions.get(&s).map_or(0, KvCache::len)
        })?;
        out.logits.clear();
        out.tokens.clear();
        out.expert_bytes = None;
        if rows.is_empty() {
            return Ok(());
        }
        if let [row] = rows {
            // One row: the single-token path, the same bits as `Batch::run` with one token
            // (batch.rs) with less around them (one region for Q, K and V, no reshapes).
            self.reserve(row.session, 1)?;
            self.advance(row.session, row.token);
            let logits = crate::forward::head(&self.model, &self.weights, &mut self.scratch);
            out.logits.extend_from_slice(logits);
            let experts: usize = self.model.layers.iter().map(|l| l.expert_bytes()).sum();
            out.expert_bytes = Some((experts * self.model.config.n_expert_used) as u64);
            choose_tokens(rows, out, &mut self.row_copies);
            return Ok(());
        }
        // The rows' caches, moved out of the map for the step (sessions are distinct: checked)
        // and back after; a new session starts empty.
        let mut kvs: Vec<KvCache> = rows
            .iter()
            .map(|r| {
                self.sessions
                    .remove(&r.session)
                    .unwrap_or_else(|| KvCache::new(c, &self.pool))
            })
            .collect();
        // Every row's page first: a refused step runs no row (its reserved pages stay with
        // their sessions, for the step that runs).
        let refused = rows
            .iter()
            .zip(&mut kvs)
            .find_map(|(r, kv)| kv.reserve(1).err().map(|e| (r.session, e)));
        if refused.is_none() {
            let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
            let of: Vec<usize> = (0..rows.len()).collect();
            let (model, weights) = (&self.model, &self.weights);
            self.batch.run(
                model,
                weights,
                &mut Seats::Runs(&mut kvs, &of),
                &tokens,
                &mut self.scratch,
            );
            self.batch
                .head(model, weights, &self.scratch, &mut out.logits);
            out.expert_bytes = Some(self.batch.experts_read);
        }
        for (row, kv) in rows.iter().zip(kvs) {
            self.sessions.insert(row.session, kv);
        }
        if let Some((session, e)) = refused {
            return Err(crate::pool_full(&self.pool, session, e));
        }
        choose_tokens(rows, out, &mut self.row_copies);
        Ok(())
    }
}
