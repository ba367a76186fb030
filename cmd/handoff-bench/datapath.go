package main

import (
	"context"
	"errors"
)

func runDatapath(ctx context.Context, args []string) error { return errors.New("datapath: not built yet") }
