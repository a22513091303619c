//! What one request may ask of a pool's servers. `max_tokens`, a size hint and a reservation's
//! token count are client input: trusted without limit, four requests declaring 10^18 tokens
//! each made every projection years long and locked every other client out. Here a request is
//! held to the servers' context window and output limit before anything is estimated from
//! it: one that cannot fit at all is refused at arrival (`context_length_exceeded`, as the
//! servers would answer), and every size the estimate, the hold and the projected wait use is
//! capped by what the servers can really produce.

use super::*;

/// A request's sizes after [`Gate::bound_request`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Bounds {
    /// Its prompt in tokens, counted with the pool's learned relation (what the estimate
    /// uses too: counted once per lane).
    pub(super) prompt_tokens: u32,
    /// The most output tokens the request can get: what is left of the context window
    /// after its prompt, and at most the pool's output limit.
    pub(super) output_cap: u32,
    /// The request cannot fit: its prompt alone, or its prompt plus its `max_tokens`, is
    /// past the context window, its `max_tokens` past the output limit, or a reservation's
    /// tokens past the window.
    pub(super) exceeds: bool,
}

impl PoolState {
    /// The context window in force: the configured one and the smallest a server reported,
    /// whichever is smaller; [`DEFAULT_CONTEXT_TOKENS`] when neither is known.
    pub(super) fn context_tokens(&self) -> u32 {
        match (self.limits.context_tokens, self.discovered_context) {
            (Some(c), Some(d)) => c.min(d),
            (Some(c), None) => c,
            (None, Some(d)) => d,
            (None, None) => DEFAULT_CONTEXT_TOKENS,
        }
    }

    /// The most output a request with `prompt_tokens` of prompt can get from this pool.
    pub(super) fn output_cap(&self, prompt_tokens: u32) -> u32 {
        let left = self.context_tokens().saturating_sub(prompt_tokens);
        self.limits.max_output_tokens.map_or(left, |m| left.min(m))
    }
}

impl Gate {
    /// Hold a request's declared sizes to what its class's pool can do: `max_tokens`, the
    /// size hint and the hold are capped in place; [`Bounds::exceeds`] says whether it could
    /// not fit at all.
    pub(super) fn bound_request(&self, class: LaneId, req: &mut Request) -> Bounds {
        let p = &self.pools[self.classes[class.0].pool.0];
        let context = p.context_tokens();
        let prompt = p.prompt_tokens(req);
        let output_cap = p.output_cap(prompt);
        // A reservation's `tokens` (its whole hold) past the window cannot be one call to
        // these servers; capping it instead would let it slip past its tenant's grant.
        let exceeds = prompt > context
            || req.max_tokens.is_some_and(|m| m > output_cap)
            || req.hold_tokens.is_some_and(|h| h > u64::from(context));
        req.max_tokens = req.max_tokens.map(|m| m.min(output_cap));
        req.expected_output_tokens = req.expected_output_tokens.map(|h| h.min(output_cap));
        req.hold_tokens = req.hold_tokens.map(|h| h.min(u64::from(context)));
        Bounds {
            prompt_tokens: prompt,
            output_cap,
            exceeds,
        }
    }

    /// What the servers of `pool` said their context window is (`None`: none said, or the
    /// ones that did are gone). The smaller of it and the configured window holds. Unknown
    /// pools are ignored (a reload may have removed it while the answer was on its way).
    pub fn set_discovered_context(&mut self, pool: &str, context_tokens: Option<u32>) {
        let value = context_tokens.map(|c| c.clamp(1, crate::config::MAX_LIMIT_TOKENS));
        if let Some(p) = self.pools.iter_mut().find(|p| p.name == pool) {
            p.discovered_context = value;
        }
    }

    /// The context window in force for `pool` (configured, reported or the default), and
    /// whether a server reported it.
    pub fn context_tokens(&self, pool: &str) -> Option<(u32, bool)> {
        self.pools
            .iter()
            .find(|p| p.name == pool)
            .map(|p| (p.context_tokens(), p.discovered_context.is_some()))
    }
}
