package worker_test

import (
	"context"
	"fmt"

	"github.com/handoff-io/handoff/hybrid"
	"github.com/handoff-io/handoff/model"
	"github.com/handoff-io/handoff/worker"
)

// An aggregated decode worker: one rank, prefill in process.
func ExampleScheduler() {
	exec, _ := model.Lookup(model.TinyHybrid)
	pools, _ := worker.PoolConfig(exec.Spec(), worker.PoolParams{MaxBatchSize: 4})
	m, _ := hybrid.New(pools)
	rank, _ := worker.NewRank(0, m, exec, make([]byte, pools.KV.ArenaBytes()), make([]byte, pools.Mamba.ArenaBytes()))
	sched, _ := worker.NewScheduler(worker.Config{Role: worker.RoleDecode}, []*worker.Rank{rank})

	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- sched.Run(ctx) }()

	s, err := sched.Generate(ctx, worker.GenerateRequest{Prompt: model.Encode("Hello"), MaxTokens: 8})
	if err != nil {
		fmt.Println(err)
		stop()
		return
	}
	var toks []int32
	for {
		ev, err := s.Next(ctx)
		if err != nil {
			fmt.Println(err)
			break
		}
		if ev.Done {
			fmt.Println("finish:", ev.Finish, "err:", ev.Err)
			break
		}
		toks = append(toks, ev.Token)
	}
	fmt.Println("tokens:", len(toks))
	stop()
	<-done
	fmt.Println("rows in use after stop:", m.Stats().RowsUsed)
	// Output:
	// finish: length err: <nil>
	// tokens: 8
	// rows in use after stop: 0
}
