//! `Backend::step_batch` on CUDA: the rows in submissions of at most a prefill chunk (batch.rs
//! builds and replays each), then each row's token: the device's arg-max for a plain greedy
//! row, else its sampler on the host over the logits that came back.

use q4moe_model::backend::{self, Backend, BackendError, BackendResult};

use super::CudaBackend;
use crate::batch::Row;
use crate::params::BT_NON_FINITE;
use crate::session::Session;
use crate::Result;

impl CudaBackend {
    pub(super) fn run_batch(
        &mut self,
        rows: &mut [backend::BatchRow<'_>],
        out: &mut backend::BatchOut,
    ) -> BackendResult<()> {
        let c = &self.model.config;
        let held = |s| self.sessions.get(&s).map_or(0, |x: &Session| x.len);
        backend::check_batch(c, rows, self.opts.kv_capacity, held)?;
        out.tokens.clear();
        if rows.is_empty() {
            out.logits.clear();
            return Ok(());
        }
        let Some(max) = self.prefill.as_ref().map(|p| p.chunk) else {
            return Err(BackendError::Unsupported(
                "the batched decode step for this geometry (rows must be multiples of 32, at \
                 most 4,096), or with the batched kernels off (--cuda-opt prefill_chunk=0)"
                    .into(),
            ));
        };
        self.dev.bind()?;
        // Every row's next position before any submission: a step the pool cannot hold grows
        // no session and runs no row, even where its rows take several submissions.
        let wants: Vec<_> = rows
            .iter()
            .map(|r| (r.session, self.kv_len(r.session) + 1))
            .collect();
        self.hold_all(&wants)?;
        let vocab = self.model.config.vocab_size;
        // Resizing to last step's length writes nothing: rows whose logits nobody reads keep
        // stale values (BatchRow::logits), and the host touches B x vocab floats only where
        // they are needed.
        out.logits.resize(rows.len() * vocab, 0.0);
        // More rows than one submission takes run as several: a row's result is its own.
        for (g, group) in rows.chunks_mut(max).enumerate() {
            let at = g * max * vocab;
            let logits = &mut out.logits[at..at + group.len() * vocab];
            self.batch_group(&mut *group, logits)?;
            // The device's arg-max for the plain greedy rows; the other samplers draw on the
            // host, in parallel across rows.
            let (mut tokens, mut host) = (vec![None; group.len()], vec![false; group.len()]);
            for (i, row) in group.iter_mut().enumerate() {
                // The step's own position: the session is one longer now.
                let pos = self.kv_len(row.session) - 1;
                let chosen = self.batch.chosen[i];
                if chosen == BT_NON_FINITE {
                    return Err(backend::non_finite(pos, "found on the device"));
                }
                match row.sampler.as_deref_mut() {
                    Some(s) if s.plain_greedy() => {
                        s.accept(chosen);
                        tokens[i] = Some(chosen);
                    }
                    Some(_) => host[i] = true,
                    None => {}
                }
            }
            backend::choose_on_host(group, logits, &host, &mut self.batch.copies, &mut tokens);
            out.tokens.extend(tokens);
        }
        Ok(())
    }

    /// One submission of `group`'s rows: their arg-maxes into `self.batch.chosen`, and into
    /// `logits` ([rows][vocab]) the logits of the rows that need them (`host_logits`).
    fn batch_group(
        &mut self,
        group: &mut [backend::BatchRow<'_>],
        logits: &mut [f32],
    ) -> Result<()> {
        let c = &self.model.config;
        let rows: Vec<Row<'_>> = group
            .iter()
            .map(|r| {
                let s = &self.sessions[&r.session];
                Row {
                    token: r.token,
                    kv: &s.kv,
                    pos: s.len,
                }
            })
            .collect();
        let p = self.prefill.as_mut().expect("checked by step_batch");
        let key = self.batch.load(&self.dev, c, p, &rows)?;
        drop(rows);
        let p = self.prefill.as_ref().expect("checked by step_batch");
        let launches = || self.batch.launches(&self.model.config, &self.w, p, &key);
        // The setup cache's rule: one submission a step, replayed from a graph captured once
        // a batch size and context chunk; off (or profiling kernels), launches one by one.
        if self.opts.setup_cache && !self.opts.profile_kernels {
            let ls = self.batch.graph_for(&key).is_none().then(launches);
            if self.batch.replay(&self.dev, key, ls)? {
                self.graph_setups.captures += 1;
            }
        } else {
            let ls = launches();
            self.launch_eager(&ls)?;
        }
        // The constrained rows' grammar engines work out their next masks while the device
        // runs the step.
        for row in group.iter_mut() {
            if let Some(s) = row.sampler.as_deref_mut() {
                s.prepare();
            }
        }
        let vocab = self.model.config.vocab_size;
        let want: Vec<bool> = group.iter().map(host_logits).collect();
        self.batch.read(&self.dev, vocab, &want, logits)?;
        for row in group {
            self.session(row.session)?.len += 1;
        }
        Ok(())
    }
}

/// Whether a batched step brings `row`'s logits to the host: where the caller reads them, or
/// chooses itself, or its sampler is not plain greedy (bt_argmax chooses for the rest).
fn host_logits(row: &backend::BatchRow<'_>) -> bool {
    row.logits || !row.sampler.as_ref().is_some_and(|s| s.plain_greedy())
}
