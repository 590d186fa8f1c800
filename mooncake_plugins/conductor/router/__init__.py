"""The Conductor as a live router: an OpenAI-compatible HTTP front over vLLM instances
that routes each request with the same policy objects as the simulator
(:mod:`..policies`), through a :class:`~.view.LiveView` of the instances."""
