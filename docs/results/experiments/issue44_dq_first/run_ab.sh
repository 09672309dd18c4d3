# from the repo root with dq_first.patch applied; .ab/ab.py is ab.py, .ab/base/ holds main's sm90.py and
# sm90_wide.py, .ab/idx/index.py is index.py with ../issue44_index_dsum/index_dsum.patch
R=$PWD
rm -rf /tmp/base && mkdir -p /tmp/base && cp -r dsv4_attention tools /tmp/base/ && cp .ab/base/sm90.py .ab/base/sm90_wide.py /tmp/base/dsv4_attention/stages/f_backward/
(cd $R && python .ab/ab.py warm new > $OUT/warm_new.txt 2>&1) &
(cd /tmp/base && python $R/.ab/ab.py warm base > $OUT/warm_base.txt 2>&1) &
wait
tail -2 $OUT/warm_new.txt $OUT/warm_base.txt
python .ab/ab.py time new 2>&1 | grep "^AB"
(cd /tmp/base && python $R/.ab/ab.py time base 2>&1 | grep "^AB")
python .ab/ab.py time new2 2>&1 | grep "^AB"
rm -rf /tmp/idx && mkdir -p /tmp/idx && cp -r dsv4_attention tools /tmp/idx/ && cp .ab/idx/index.py /tmp/idx/dsv4_attention/stages/f_backward/ && (cd /tmp/idx && python $R/.ab/ab.py index dsum-kernel 2>&1 | grep "^AB")
python .ab/ab.py index main 2>&1 | grep "^AB"
