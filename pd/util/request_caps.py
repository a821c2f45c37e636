"""The caps on one generation request, one default each, shared by the router (pd.router.config, which says
why each value) and the reference engine (pd.engines.settings, pd.engines.api.limits), which apply the same caps so a
request the router passes is not refused by an engine behind it."""

MAX_N = 16  # samples per prompt
MAX_BATCH_SIZE = 256  # prompts in one batch request
MAX_SEQUENCES_PER_REQUEST = 512  # prompts x n
MAX_BODY_BYTES = 32 * 1024 * 1024  # a request body, in bytes
