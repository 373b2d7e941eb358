"""The cache service's SDK: CacheClient (the worker and the scheduler call the
cache through it), and what its client and its server both speak: the
snapshot chunk codec and the shared arena mapped into the client's process.

Imports kvstash.errors, kvstash.common and kvstash.v1, never a service or the
launcher.
"""
