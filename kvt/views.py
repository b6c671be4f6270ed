"""Copies and views of a KV cache, the plumbing cache.Cache inherits (as mapper.Mapper inherits
loading.MapperWeights): rows of a batch (select), one row repeated (expand), a span of slots (crop), a
copy moved (to). select, expand and crop return views: no copy. The method needs none of them; the
evaluation and the timings do.
"""


class CacheViews:
    def _map(self, fn, time_fn=None):
        """A new (plain) Cache with fn applied to every tensor (keys/values/queries on dim 0 and 2, the rest
        on 0/1); its tensors may be views of this cache's."""
        queries = None if self.queries is None else [fn(q) for q in self.queries]
        Cache = next(c for c in type(self).__mro__ if CacheViews in c.__bases__)  # the plain one, also for a Reserved
        return Cache([fn(k) for k in self.keys], [fn(v) for v in self.values],
                     (time_fn or fn)(self.positions), (time_fn or fn)(self.mask), queries, self.full)

    def select(self, idx):
        """Rows idx of the batch."""
        return self._map(lambda t: t[idx])

    def expand(self, n):
        """A batch-1 cache repeated n times (views, no copy): one context, n continuations."""
        assert self.positions.shape[0] == 1, "expand needs a batch-1 cache"
        return self._map(lambda t: t.expand(n, *t.shape[1:]))

    def crop(self, t0, t1):
        """Time slots [t0, t1)."""
        return self._map(lambda t: t[:, :, t0:t1], time_fn=lambda t: t[:, t0:t1])

    def to(self, device=None, dtype=None):
        def move(t):
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)
        return self._map(move)

