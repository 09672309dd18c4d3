# On the device, from the repo root of main (unpatched), `.ab/` holding this folder's files:
#   source .device/env.sh && bash .ab/run_ab.sh
# base = main's tree in /tmp/base; new = /tmp/new with dq_tma_store.patch applied. Each variant
# compiles on the check's first call (file cache), then times base, new, base again.
R=$PWD
for t in base new; do rm -rf /tmp/$t && mkdir -p /tmp/$t && cp -r dsv4_attention tools /tmp/$t/; done
(cd /tmp/new && patch -p1 < $R/.ab/dq_tma_store.patch) || exit 1
(cd /tmp/new && python $R/.ab/ab.py check new 2>&1 | grep -E "^AB|Error") &
(cd /tmp/base && python $R/.ab/ab.py check base 2>&1 | grep -E "^AB|Error") &
wait
(cd /tmp/base && python $R/.ab/ab.py time base 2>&1 | grep "^AB")
(cd /tmp/new && python $R/.ab/ab.py time new 2>&1 | grep "^AB")
(cd /tmp/base && python $R/.ab/ab.py time base2 2>&1 | grep "^AB")
