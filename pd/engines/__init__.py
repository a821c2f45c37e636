"""The reference engine: a small, exact CPU engine that speaks SGLang's HTTP and PD protocol."""
