"""The old path of `refimpl.launch._torchrun`, kept because chapter 10 imports
`attempt_store` from it to show how each torchrun attempt gets keys of its own. The code
lives in `refimpl.launch._torchrun`; import it from there."""

from __future__ import annotations

from refimpl.launch._torchrun import AttemptStoreError, RankInfo, attempt_store, init_from_env

__all__ = ["AttemptStoreError", "RankInfo", "attempt_store", "init_from_env"]
