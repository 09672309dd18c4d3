# On the device from main's root, .ab/ holding tile128.patch and ab.py: source .device/env.sh && bash .ab/run_ab.sh
R=$PWD
for t in base new; do rm -rf /tmp/$t && mkdir -p /tmp/$t && cp -r dsv4_attention tools tests pyproject.toml /tmp/$t/ 2>/dev/null; cp -r conftest.py pytest.ini setup.cfg /tmp/$t/ 2>/dev/null; done
(cd /tmp/new && patch -p1 < $R/.ab/tile128.patch) || exit 1
(cd /tmp/new && python -m pytest -q -p no:cacheprovider -n 12 tests/test_f_gpu.py -k "64 and not index and not v4 and not bad" 2>&1 | tail -15) &
(cd /tmp/base && python $R/.ab/ab.py warm_base >/dev/null 2>&1) &
wait
(cd /tmp/base && python $R/.ab/ab.py base 2>&1 | grep "^AB")
(cd /tmp/new && python $R/.ab/ab.py new 2>&1 | grep "^AB")
(cd /tmp/base && python $R/.ab/ab.py base2 2>&1 | grep "^AB")
