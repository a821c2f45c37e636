"""pdserve: prefill-decode disaggregated LLM serving (import root ``pd``)."""

__version__ = "0.1.0"
