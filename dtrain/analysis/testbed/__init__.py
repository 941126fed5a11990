"""The emulated cluster (`python -m dtrain.analysis.testbed`, `dtrain testbed`): `cli` (its command line), `net`
(namespaces, the bridge, shaped links), `links` (the links and the testbed profile), `jobs` (a torchrun agent per
node), `disks` (each node's private run directories, caches and /tmp)."""
