"""What runs a stack on one machine: the `kvstash` command (cli), the
launcher that starts the services as processes (stack, processes), the
Shepherd Model Gateway in front of them (gateway), the demo, and the small
OpenAI-HTTP client the demo, benchmarks and tests call the gateway with.

It starts the services as processes and never imports one; no service and no
other kvstash package imports it.
"""
