"""What the pages of this site use to measure and prove what they say: none of it is DCP.

A recipe's visible code is the code a reader keeps. The page around it also proves
its claims (the checkpoint equals the state at the save, bit for bit), measures what
it reports (stalls, host memory, disk speed), injects faults (a writer that stops
half-way, a rank killed at a byte) and draws figures. That work lives here, one module
per concern, and a page calls it in one line, in a cell of its own, next to the claim
it proves:

* ``observe``: watch a torch function while the page's ranks run, and get back what
  each rank's calls saw; nothing of torch stays changed after the block;
* ``proofs``: the state a page saved, reassembled from every rank's shards, compared
  with what it loaded, tensor by tensor;
* ``results``: the page's results file; every claim decided by a comparison that
  raises when it does not hold, every value recorded for the build and the tests;
* ``stats``: medians, spreads, and whether a difference is more than noise;
* ``timing``, ``memory``, ``disk``: clocks and timelines, host memory, disk limits;
* ``stalls``, ``speeds``: what the stall benchmark and the speed page conclude from their
  rounds (medians, ratios, goals, advice), and their tables;
* ``neighbors``: what a process copying or writing on another core costs a training step;
* ``reads``: what a load read from a checkpoint's files, key by key, where its time went
  (a profile by phase), and parts of states;
* ``faults``: writers and stagers that pause or fail on cue, as context managers;
* ``restarts``: real torchrun jobs restarted after a kill, counted per way of forming the group;
* ``processes``: the helper processes torch starts for a rank (a checkpoint process), and
  their logs;
* ``figures``: tables rendered as HTML, and plots;
* ``machine``: what the page ran on, and whether it hands free memory back to its host;
* ``object_store``: a real S3 server (SeaweedFS) on loopback, for a page's length;
* ``ports``: free loopback ports (a rendezvous, a server), for pages, tests and tools;
* ``versions_matrix``: the committed version matrix (checkpoints saved by one torch
  release, loaded by another) as tables, and the claims a page makes from it.

Downloads leave all of it out: the site build removes every statement that uses this
package from a page's script and notebook, so a download is the recipe alone.
"""
