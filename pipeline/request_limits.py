"""Limits on a request that the API and the scheduler both enforce."""

from __future__ import annotations

# The most ``stop_token_ids`` one request may carry (logit_bias's limit). The API refuses
# more with a 400, and the scheduler's admission refuses them again: every running request
# shares one stop table as wide as the widest request's list, and each stop check (and
# min_new_tokens' mask) reads all of it.
MAX_STOP_TOKEN_IDS = 1024
