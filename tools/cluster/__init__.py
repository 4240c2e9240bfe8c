"""A real Slurm cluster on one machine (``make cluster`` / ``make cluster-down``).

Network namespaces on an isolated bridge stand in for the hosts: a controller (slurmctld, munged),
a storage host (the shared file system, served over SFTP through a ``tc tbf``-capped link) and
CLUSTER_NODES compute nodes (slurmd each, own hostname, own /etc/hosts, own node-local disk, the
shared file system and a BeeOND stand-in mounted at the same paths on every node). Everything lives
under ``<repo>/.cluster`` and in namespaces named ``stgr-<tag>-*``; ``down`` removes exactly that.
tools/cluster/README.md explains the layout and the environment it writes (``.cluster/env``).
"""
