"""`kvstash sim`: the scheduler core that serves (scheduler_svc/core), unchanged,
stepped in virtual time against a simulated worker and cache whose costs come
from a profile (profile.py), on a trace (kvstash.workload). Its decisions are
the real ones; only the timing is modelled."""
