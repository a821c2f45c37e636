"""The cluster runtime: the Ray job (launch), the worker actors that supervise engines, and what they share."""
